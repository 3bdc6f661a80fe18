"""The trainer configuration: YAML, dotted overrides, the names users know, clear errors."""

from __future__ import annotations

import pytest

from trainer.config import (
    ConfigError,
    Dtype,
    PaddingSide,
    ReplayMode,
    TrainConfig,
    TrainerConfig,
    load_config,
)


def test_defaults_are_disabled():
    config = load_config()
    assert config.router_replay.mode is ReplayMode.DISABLED
    assert not config.router_replay.enabled


def test_yaml_then_dotted_overrides(tmp_path):
    path = tmp_path / "trainer.yaml"
    path.write_text(
        "model:\n  path: some/model\nrouter_replay:\n  mode: R2\n  record_file: r.bin\n"
        "train:\n  lr: 1\n"
    )
    config = load_config(path, ["router_replay.mode=R3", "router_replay.replay_file=x.bin"])
    assert config.router_replay.mode is ReplayMode.R3
    assert config.router_replay.replay_file == "x.bin"
    assert config.router_replay.record_file == "r.bin"
    assert config.train.lr == 1.0 and isinstance(config.train.lr, float)
    assert config.model.path == "some/model"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["router_replay.mode=R4"], r"router_replay.mode='R4' is not one of \['disabled', 'R2'"),
        (["router_replay.modes=R2"], "unknown key 'router_replay.modes'"),
        (["train.seed=abc"], "train.seed='abc' must be of type int"),
        (["router_replay.mode=R2", "router_replay.replay_file=f"], "which is mode R3"),
        (["router_replay.mode=R3"], "needs route_cache.target or router_replay.replay_file"),
        (
            ["router_replay.missing_record=skip"],
            r"router_replay.missing_record='skip' is not one of \['error', 'native'\]",
        ),
        (["train.dtype=float16"], r"train.dtype='float16' is not one of \['float32', 'bfloat16'\]"),
        (["train.padding_side=up"], r"train.padding_side='up' is not one of \['right', 'left'\]"),
        (["data.source=queue"], r"data.source='queue' is not one of \['ids', 'feed'\]"),
        (["router_replay"], "must look like section.key=value"),
        (["parallel.vp=2"], r"parallel.vp=2 needs pipeline stages \(parallel.pp > 1\)"),
        (
            [
                "parallel.pp=2",
                "parallel.vp=2",
                "train.micro_batch_size=2",
                "train.mini_batch_size=2",
            ],
            "interleaved schedule needs the micro-batches of an optimizer step to be a multiple",
        ),
        (["train.mini_batch_size=6"], "train.micro_batch_size=4 must divide"),
        (["train.max_tokens_per_micro_batch=0"], "max_tokens_per_micro_batch must be >= 1"),
    ],
)
def test_bad_values_fail_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_settings_built_in_code_are_checked_like_yaml():
    config = TrainerConfig(train=TrainConfig(dtype="bfloat16", padding_side="left"))
    config.validate()
    assert config.train.dtype is Dtype.BFLOAT16 and config.train.padding_side is PaddingSide.LEFT
    with pytest.raises(ConfigError, match=r"train.dtype='bf16' is not one of"):
        TrainerConfig(train=TrainConfig(dtype="bf16")).validate()
