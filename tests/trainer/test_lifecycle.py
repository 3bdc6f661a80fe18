"""The trainer's life beyond one step: weights exported for the rollout server, checkpoints and
resume, determinism, a reward that improves, TensorBoard, megatron's aux loss beside replay.

Real megatron-core on the CPU, the tiny model, rollout records from transformers float32
sampling (the rollout server's contract), 8 samples of 10 generated tokens per batch.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from tests.trainer.helpers import random_batch, random_routes
from trainer import checkpoint
from trainer.config import load_config
from trainer.data.source import BatchPlan
from trainer.model.export import export_hf
from trainer.model.hf_weights import load_hf_state_dict
from trainer.train import build, train

LOGIT_ATOL = 1e-5  # the parity tolerance of test_model_parity.py


def _config(tiny_model_dir, rollout_file, *overrides):
    return load_config(
        None,
        [
            f"model.path={tiny_model_dir}",
            f"data.records_file={rollout_file}",
            "train.batch_size=8",
            "router_replay.mode=R3",
            *overrides,
        ],
    )


def _plans(rollout, n):
    return [BatchPlan([r.sample_id for r in rollout])] * n


def _weights(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _hf_logits(model_dir, batch):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf(batch.sample_tokens(b)[None]).logits[0] for b in range(batch.batch_size)]


# -- 1. weights back to the rollout server ---------------------------------------------------


def test_export_of_untouched_weights_is_bitwise_the_source(tiny_model_dir, pg_collection, tmp_path):
    config = _config(tiny_model_dir, "unused.npz")
    built, _ = build(config, pg_collection)
    out = export_hf(built, tiny_model_dir, tmp_path / "export", max_shard_bytes=1 << 20)
    assert (out / "model.safetensors.index.json").exists()  # sharded: > 1 MiB of weights
    exported, source = load_hf_state_dict(out), load_hf_state_dict(tiny_model_dir)
    assert sorted(exported) == sorted(source)
    for name, tensor in source.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (tiny_model_dir / name).read_bytes(), name


def test_trained_weights_exported_load_in_transformers_with_megatrons_logits(
    tiny_model_dir, rollout_file, rollout, pg_collection, tmp_path
):
    from transformers import AutoTokenizer

    export_dir = tmp_path / "exports"
    config = _config(
        tiny_model_dir,
        rollout_file,
        "train.lr=1e-3",
        "train.ppo_epochs=1",
        f"train.export_dir={export_dir}",
        "train.export_every=2",
        "report.compare=false",
    )
    built = build(config, pg_collection)
    before = load_hf_state_dict(tiny_model_dir)
    train(config, _plans(rollout, 3), pg_collection=pg_collection, built=built)
    # Every 2 steps, and after the last one.
    assert sorted(p.name for p in export_dir.iterdir()) == ["latest", "step_000002", "step_000003"]
    out = export_dir / (export_dir / "latest").read_text().strip()
    assert out.name == "step_000003"
    changed = load_hf_state_dict(out)
    assert not torch.equal(
        changed["model.layers.1.mlp.gate.weight"], before["model.layers.1.mlp.gate.weight"]
    )
    model = built[0].model.eval()
    batch = random_batch(5, [11, 6], "right")
    with torch.no_grad():
        ours = model(batch.token_ids, batch.position_ids(), batch.attention_mask())
    worst = 0.0
    for b, ref in enumerate(_hf_logits(out, batch)):
        n = int(batch.lengths[b])
        worst = max(worst, float((ours[b, :n] - ref).abs().max()))
    assert worst <= LOGIT_ATOL, worst
    assert AutoTokenizer.from_pretrained(out).encode("def add(a, b):")


# -- 2. checkpoints, resume, determinism -----------------------------------------------------


def test_resume_after_a_crash_equals_an_uninterrupted_run(
    tiny_model_dir, rollout_file, rollout, pg_collection, tmp_path
):
    common = ("train.lr=1e-3", "train.ppo_epochs=1", "report.compare=false")
    straight_cfg = _config(tiny_model_dir, rollout_file, *common)
    straight = build(straight_cfg, pg_collection)
    straight_reports = train(
        straight_cfg, _plans(rollout, 3), pg_collection=pg_collection, built=straight
    )

    ckpt = tmp_path / "ckpt"
    cfg = _config(tiny_model_dir, rollout_file, *common, f"train.checkpoint_dir={ckpt}")
    first = train(cfg, _plans(rollout, 2), pg_collection=pg_collection)  # then "crashes"
    assert checkpoint.latest(ckpt).name == "step_000002.pt"
    torch.manual_seed(999)  # the restarted process's RNG is anything; the checkpoint restores it
    resumed = build(cfg, pg_collection)
    rest = train(cfg, _plans(rollout, 3), pg_collection=pg_collection, built=resumed)
    assert [r.step for r in rest] == [2]
    assert [r.loss for r in first + rest] == [r.loss for r in straight_reports]
    ours, theirs = _weights(resumed[0].model), _weights(straight[0].model)
    for name, w in theirs.items():
        assert torch.equal(ours[name], w), name
    assert checkpoint.latest(ckpt).name == "step_000003.pt"


def test_two_runs_with_the_same_seed_are_identical(
    tiny_model_dir, rollout_file, rollout, pg_collection
):
    config = _config(tiny_model_dir, rollout_file, "train.lr=1e-3", "train.seed=7")
    runs = []
    for _ in range(2):
        built = build(config, pg_collection)
        reports = train(config, _plans(rollout, 2), pg_collection=pg_collection, built=built)
        runs.append(([r.loss for r in reports], _weights(built[0].model)))
    (loss_a, w_a), (loss_b, w_b) = runs
    assert loss_a == loss_b
    for name, w in w_a.items():
        assert torch.equal(w_b[name], w), name


# -- 3. a reward that improves ---------------------------------------------------------------


def test_expected_reward_rises_step_over_step(tiny_model_dir, rollout_file, rollout, pg_collection):
    config = _config(tiny_model_dir, rollout_file, "train.lr=3e-3", "report.compare=false")
    reports = train(config, _plans(rollout, 4), pg_collection=pg_collection)
    expected = [r.expected_reward for r in reports]
    print("expected reward per step", [round(x, 4) for x in expected])
    assert all(b > a for a, b in zip(expected, expected[1:], strict=False)), expected
    assert expected[-1] > 1.1 * expected[0], expected


# -- 4. TensorBoard --------------------------------------------------------------------------


def test_report_is_logged_to_tensorboard(
    tiny_model_dir, rollout_file, rollout, pg_collection, tmp_path
):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logdir = tmp_path / "tb"
    config = _config(
        tiny_model_dir, rollout_file, "train.ppo_epochs=1", f"report.tensorboard_dir={logdir}"
    )
    reports = train(config, _plans(rollout, 2), pg_collection=pg_collection)
    assert list(logdir.glob("events.out.tfevents.*"))
    events = EventAccumulator(str(logdir))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    expected = {
        "reward/mean",
        "reward/expected",
        "loss",
        "clip_fraction",
        "rows/replayed_fraction",
        "update_agreement/epoch_0",
        "time/update",
        "time/fetch_wait",
        "time/old_logprob",
        *(f"agreement/exact/layer_{layer}" for layer in (1, 2, 3)),
        *(
            f"gap/{name}/{key}"
            for name in ("natural", "replayed")
            for key in ("mean_abs", "max_abs", "k3_kl", "ratio_gt_2")
        ),
    }
    assert expected <= tags, expected - tags
    loss = events.Scalars("loss")
    assert [e.step for e in loss] == [0, 1]
    assert [e.value for e in loss] == pytest.approx([r.loss for r in reports], rel=1e-6)
    k3 = events.Scalars("gap/natural/k3_kl")
    assert k3[0].value == pytest.approx(reports[0].gap["natural"].k3_kl, rel=1e-6, abs=1e-12)


# -- 5. megatron's aux loss beside replay ----------------------------------------------------


def test_aux_loss_beside_replay_is_finite_and_from_natural_routing(
    tiny_model_dir, rollout_file, rollout, pg_collection
):
    from megatron.core.transformer.moe import moe_logging, moe_utils

    from tests.trainer.helpers import capture_routing

    coeff = 0.01
    config = _config(
        tiny_model_dir,
        rollout_file,
        f"model.aux_loss_coeff={coeff}",
        "train.ppo_epochs=1",
        "report.compare=false",
    )
    built, optimizer = build(config, pg_collection)
    geometry = built.geometry
    assert all(r.router.is_aux_loss_enabled() for r in built.routers)

    # Forced random routes, one training forward: each layer's tracked aux loss is megatron's
    # formula on the router's *natural* top-k of its logits, not on the replayed routes.
    batch = random_batch(11, [9, 7], "right")
    rows = batch.seq_len * batch.batch_size
    forced = torch.from_numpy(random_routes(4, rows, geometry).astype(np.int64))
    indices = [forced[:, j].contiguous() for j in range(geometry.num_moe_layers)]
    moe_utils.clear_aux_losses_tracker()
    with built.replay.step(), capture_routing(built.routers) as (maps, logits):
        with built.replay.forward(indices):
            out = built.model(batch.token_ids, batch.position_ids(), batch.attention_mask())
        with built.replay.backward():
            out.float().mean().backward()
    tracked = moe_utils.get_moe_layer_wise_logging_tracker()["load_balancing_loss"]["values"]
    k, experts = geometry.topk, geometry.num_experts
    for j, layer in enumerate(geometry.moe_layers):
        scores = torch.softmax(logits[layer][0].float(), dim=-1)
        natural = torch.zeros_like(scores).scatter(1, scores.topk(k, dim=-1).indices, 1.0)
        replayed = maps[layer][0].float()
        assert torch.equal(
            replayed.bool(), torch.zeros_like(replayed).scatter(1, indices[j], 1.0).bool()
        )

        def formula(routing_map, scores=scores):
            per_expert = routing_map.sum(0)
            return float((scores.sum(0) * per_expert).sum() * experts / (k * rows * rows))

        assert float(tracked[layer]) == pytest.approx(formula(natural), rel=1e-5), layer
        assert abs(formula(replayed) - formula(natural)) > 1e-4  # the two would differ
    moe_utils.clear_aux_losses_tracker()

    # In the RL loop, with R3 replay: training runs and the reported aux loss is finite.
    reports = train(
        config, _plans(rollout, 2), pg_collection=pg_collection, built=(built, optimizer)
    )
    for r in reports:
        assert r.aux_loss is not None and math.isfinite(r.aux_loss) and r.aux_loss > 0
        assert len(r.aux_loss_layers) == geometry.num_moe_layers
        assert math.isfinite(r.loss)
    # megatron's logging path with force_initialize allocates no CUDA tensor (0.19 does it on
    # the CPU itself; 0.16.1 needed a patch).
    tracker = moe_logging.get_moe_metrics_tracker()
    tracker.clear()
    tracker.report(
        1.0,
        0,
        track_names=["load_balancing_loss"],
        num_layers=len(built.model.decoder.layers),
        moe_layer_freq=[0, 1, 1, 1],
        force_initialize=True,
        pg_collection=pg_collection,
    )
