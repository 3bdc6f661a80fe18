"""Live weight updates: records after an update match the oracle on the NEW checkpoint on every
MoE layer (a reload without the kernel drop, which lays the new experts out wrongly, fails
this), prefix-cache hits do not bring back the old weights' routes, and a sample running across
the update finishes on the old version and says so. The test restores the original weights for
the rest of the session."""

from __future__ import annotations

import asyncio

import pytest

from routereplay.domain.rollout import SampleDone, SamplingOptions
from routereplay.errors import FailedPrecondition, InvalidArgument, NotFound
from tests.rollout_server.oracle import assert_record_matches, load_hf_model

# Long enough for several KV blocks, so a repeat can hit the prefix cache.
PROMPT = 3 * (
    "Reinforcement learning samples rollouts from an inference engine and trains the policy "
    "on them. When the engine and the trainer pick different experts for the same token, "
    "the trainer optimises a policy that did not produce the samples. "
)
GREEDY = SamplingOptions(temperature=0.0, max_tokens=8)


@pytest.fixture(scope="module")
def second_checkpoint(tmp_path_factory):
    from routereplay.dev.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-seed1"), seed=1)


async def final_of(stream) -> SampleDone:
    events = [e async for e in stream]
    assert isinstance(events[-1], SampleDone)
    return events[-1]


def test_update_weights_live(
    rollout, cache_reader, hf_model, loop, tiny_model_dir, second_checkpoint
):
    server, client = rollout
    hf_new = load_hf_model(second_checkpoint)
    v0 = server.rollout.policy_version

    async def before_and_during():
        old = await final_of(client.generate(PROMPT, GREEDY))  # fills the prefix cache
        # A long sample running when the update is asked for: the update waits for it.
        running = asyncio.ensure_future(
            final_of(client.generate(PROMPT, SamplingOptions(temperature=1.0, max_tokens=80)))
        )
        await asyncio.sleep(0.3)
        update = await client.update_weights(str(second_checkpoint))
        return old, await running, update

    old, spanning, update = loop.run_until_complete(before_and_during())
    assert update.policy_version == v0 + 1
    for final in (old, spanning):
        assert final.stored and final.turn.policy_version == v0
        assert_record_matches(hf_model, cache_reader.read(final.sample_id))

    try:
        new = loop.run_until_complete(final_of(client.generate(PROMPT, GREEDY)))
        assert new.turn.policy_version == v0 + 1
        assert new.cached_tokens == 0, "the update must empty the prefix cache"
        # The same prompt again: the prefix cache was emptied, so no old-weights rows.
        record = cache_reader.read(new.sample_id)
        assert_record_matches(hf_new, record)
        # A second request with the same prompt hits the (new) prefix cache: still new routes.
        again = loop.run_until_complete(final_of(client.generate(PROMPT, GREEDY)))
        assert again.cached_tokens > 0
        assert_record_matches(hf_new, cache_reader.read(again.sample_id))
        status = loop.run_until_complete(client.status())
        assert status.policy_version == v0 + 1
    finally:  # the other tests expect the original weights
        back = loop.run_until_complete(client.update_weights(str(tiny_model_dir)))
        assert back.policy_version == v0 + 2
    restored = loop.run_until_complete(final_of(client.generate(PROMPT, GREEDY)))
    assert restored.turn.policy_version == v0 + 2
    assert_record_matches(hf_model, cache_reader.read(restored.sample_id))


def test_update_weights_refuses_bad_checkpoints(rollout, loop, tmp_path, tiny_model_dir):
    from routereplay.dev.tiny_model import build_tiny_model

    server, client = rollout
    version = server.rollout.policy_version
    with pytest.raises(NotFound, match="path"):
        loop.run_until_complete(client.update_weights(str(tmp_path / "missing")))
    with pytest.raises(InvalidArgument, match="config.json"):
        loop.run_until_complete(client.update_weights(str(tmp_path)))
    other = build_tiny_model(tmp_path / "other")
    config = (other / "config.json").read_text().replace('"mlp_only_layers": [\n    0\n  ]', "X")
    (other / "config.json").write_text(config.replace("X", '"mlp_only_layers": []'))
    with pytest.raises(FailedPrecondition, match="geometry"):
        loop.run_until_complete(client.update_weights(str(other)))
    with pytest.raises(InvalidArgument, match="policy_version"):
        loop.run_until_complete(client.update_weights(str(tiny_model_dir), version))
    assert server.rollout.policy_version == version


def changed_config_checkpoint(folder, source, **changes):
    """``source``'s files (linked) with its ``config.json`` changed by ``changes``
    (``{"rope_parameters": {"rope_theta": 500.0}}`` merges into the nested dict)."""
    import json

    folder.mkdir()
    for file in source.iterdir():
        if file.name != "config.json":
            (folder / file.name).symlink_to(file)
    config = json.loads((source / "config.json").read_text())
    for key, value in changes.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def test_update_weights_refuses_a_changed_config(rollout, loop, tmp_path, tiny_model_dir):
    """A checkpoint whose config.json differs from the served model's (rope_theta 10000 -> 500,
    the norm's epsilon) is refused with FAILED_PRECONDITION naming the keys: a reload loads
    weights only, so the engine would go on computing with the served configuration."""
    server, client = rollout
    version = server.rollout.policy_version
    rope = changed_config_checkpoint(
        tmp_path / "rope", tiny_model_dir, rope_parameters={"rope_theta": 500.0}, rms_norm_eps=1e-5
    )
    with pytest.raises(FailedPrecondition, match=r"in rms_norm_eps, rope_parameters\.rope_theta;"):
        loop.run_until_complete(client.update_weights(str(rope)))
    assert server.rollout.policy_version == version


def test_config_keys_free_to_differ(tiny_model_dir):
    """What wrote a checkpoint and the dtype it was saved in may differ; nothing else may."""
    import json

    from rollout_server.weights import config_differences

    served = json.loads((tiny_model_dir / "config.json").read_text())
    exported = {
        **served,
        "transformers_version": "9.9.9",
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
        "_name_or_path": "/exports/step-3",
    }
    assert config_differences(exported, served) == []
    changed = {**exported, "use_cache": False, "architectures": ["MixtralForCausalLM"]}
    del changed["sliding_window"]
    assert config_differences(changed, served) == ["architectures", "sliding_window", "use_cache"]
