"""``python -m trainer`` under pipeline stages, virtual stages, packing and token budgets: the
same RL steps as one rank with fixed, padded micro-batches.

Every pass runs through megatron's own schedule (1F1B under ``parallel.pp``, interleaved 1F1B
under ``parallel.vp``). Against one rank only the float summation order differs (under
pipeline stages every micro-batch of a step is padded to one shape, which changes the
matmuls' blocking; packing and token budgets change the rows summed together): measured
|d loss| <= 3.3e-7 (PP2 x VP2 with recompute; 0.0 for PP2; 6.2e-7 with AVX2 kernels, over the
5e-7 this test once held it to), |d gap mean| <= 6e-8 (2.2e-6 with AVX2 kernels), the same
routing agreement, update agreement and rows, and ``replay_followed`` 1.0 on every layer of
every stage. The loss's bound, 2.74e-6, is derived in tests/trainer/tolerance.py. Replaying a
stage's routes on the wrong layers, or packing a route one token off, breaks these
(docs/trainer.md).
"""

# ruff: noqa: F811 (pytest fixtures imported from other test modules)
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from routereplay.domain.record_file import load_records, save_records
from tests.trainer.helpers import assert_same_counts
from tests.trainer.model.test_sharded_weights import (
    GAP_ATOL,
    LOSS_ATOL,
    WEIGHT_ATOL,
    WEIGHT_MEAN_ATOL,
    _exported,
    _trainer,
)
from tests.trainer.parallel.test_dp_train import records  # noqa: F401 (fixture)
from tests.trainer.parallel.test_multirank import tiny8_model_dir  # noqa: F401 (fixture)
from tests.trainer.ranks import run_each_rank
from trainer.report.step_report import StepReport

pytest.importorskip("megatron.core")
pytestmark = pytest.mark.slow


def _same_steps(got: list[StepReport], want: list[StepReport]) -> None:
    assert len(got) == len(want)
    for step, ref in zip(got, want, strict=True):
        assert_same_counts(step, ref)
        if ref.replay_followed is not None:
            assert step.replay_followed == ref.replay_followed
            assert set(step.replay_followed.exact) == {1.0}
        assert step.loss == pytest.approx(ref.loss, abs=LOSS_ATOL)
        assert step.expected_reward == pytest.approx(ref.expected_reward, abs=LOSS_ATOL)
        for name, gap in ref.gap.items():
            assert step.gap[name].tokens == gap.tokens
            assert step.gap[name].mean_abs == pytest.approx(gap.mean_abs, abs=GAP_ATOL)


def _same_weights(ours: dict, theirs: dict) -> None:
    assert ours.keys() == theirs.keys()
    diff = torch.cat([(t - theirs[n]).abs().flatten() for n, t in ours.items()])
    assert diff.max() <= WEIGHT_ATOL and diff.mean() <= WEIGHT_MEAN_ATOL, diff.max()


def _run(model_dir, records_file, tmp_path, name, mode, *extra, nproc=1):
    folder = tmp_path / name
    folder.mkdir()
    extra = [*extra, f"router_replay.record_file={folder / 'used.npz'}"]
    proc, reports = _trainer(model_dir, records_file, folder / "r.json", mode, *extra, nproc=nproc)
    return proc, reports, folder


_TP2SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]


@pytest.mark.parametrize(
    ("layout", "nproc", "extra", "mode"),
    [
        ("pp2", 2, ["parallel.pp=2"], "R3"),
        ("pp2", 2, ["parallel.pp=2"], "R2"),
        ("pp2", 2, ["parallel.pp=2"], "disabled"),
        ("tp2sp_pp2", 4, ["parallel.pp=2", *_TP2SP], "R3"),
        ("dp2_pp2", 4, ["parallel.pp=2", "parallel.dp=2"], "R3"),
    ],
)
def test_pipeline_stages_train_like_one_rank(
    layout, nproc, extra, mode, tiny_model_dir, records, tmp_path
):
    _, want, one = _run(tiny_model_dir, records, tmp_path, "one", mode)
    proc, got, run = _run(tiny_model_dir, records, tmp_path, layout, mode, *extra, nproc=nproc)
    assert proc.stdout.count(f"step 1 [{mode}]") == 1, proc.stdout[-3000:]  # the lead logs
    _same_steps(got, want)
    # Every stage's layers in the lead's export, trained as one rank trains them.
    _same_weights(_exported(run), _exported(one))
    # The routes used (R2: recorded per stage and rank, assembled) are one rank's, whole.
    ours, theirs = load_records(run / "used.npz"), load_records(one / "used.npz")
    assert [r.sample_id for r in ours] == [r.sample_id for r in theirs]
    for a, b in zip(ours, theirs, strict=True):
        np.testing.assert_array_equal(a.routes, b.routes)


@pytest.fixture(scope="module")
def records8(tiny8_model_dir, tmp_path_factory):
    from routereplay.dev.hf_rollout import random_prompts, rollout_records

    prompts = random_prompts(2, [5, 8], 512, seed=3)
    recs = rollout_records(tiny8_model_dir, prompts, group_size=2, new_tokens=8, seed=0)
    return save_records(tmp_path_factory.mktemp("vp") / "rollout.npz", recs)


def test_virtual_stages_with_recompute_train_like_one_rank(
    tiny8_model_dir,
    records8,
    tmp_path,
):
    """PP2 x VP2 (4 chunks of 2 layers), interleaved 1F1B, activation recompute: 2
    micro-batches per optimizer step, the multiple of pp the interleaved schedule runs."""
    extra = ["train.micro_batch_size=1", "train.mini_batch_size=2", "model.recompute=true"]
    _, want, one = _run(tiny8_model_dir, records8, tmp_path, "one", "R3", *extra)
    proc, got, run = _run(
        tiny8_model_dir,
        records8,
        tmp_path,
        "vp",
        "R3",
        *extra,
        "parallel.pp=2",
        "parallel.vp=2",
        nproc=2,
    )
    _same_steps(got, want)
    _same_weights(_exported(run), _exported(one))


@pytest.mark.parametrize(
    ("name", "extra", "reference"),
    [
        # Packed (remove-padding) against the padded micro-batches of the same samples.
        ("packed", ["train.packing=true"], []),
        ("packed_pp2", ["train.packing=true", "parallel.pp=2"], []),
        # Micro-batches filled to a token budget against 2 fixed ones per optimizer step.
        (
            "budget",
            ["train.max_tokens_per_micro_batch=40", "train.mini_batch_size=4"],
            ["train.mini_batch_size=4"],
        ),
    ],
)
def test_packed_and_token_budget_micro_batches_train_like_padded_ones(
    name,
    extra,
    reference,
    tiny_model_dir,
    records,
    tmp_path,
):
    nproc = 2 if "parallel.pp=2" in extra else 1
    _, want, one = _run(tiny_model_dir, records, tmp_path, "one", "R3", *reference)
    _, got, run = _run(tiny_model_dir, records, tmp_path, name, "R3", *extra, nproc=nproc)
    _same_steps(got, want)
    _same_weights(_exported(run), _exported(one))
    # Results in the batch's original order.
    ours, theirs = load_records(run / "used.npz"), load_records(one / "used.npz")
    assert [r.sample_id for r in ours] == [r.sample_id for r in theirs]


def test_a_token_budget_below_the_longest_sample_fails_on_every_rank(
    tiny_model_dir,
    records,
    tmp_path,
):
    import sys

    args = [
        sys.executable,
        "-m",
        "trainer",
        f"model.path={tiny_model_dir}",
        f"data.records_file={records}",
        "parallel.pp=2",
        "router_replay.mode=R3",
        "train.batch_size=4",
        "train.micro_batch_size=2",
        "train.max_tokens_per_micro_batch=8",
        "--steps",
        "1",
    ]
    for returncode, _, stderr in run_each_rank(args):
        assert returncode != 0
        assert "exceeds the micro-batch budget of 8 tokens" in stderr, stderr[-3000:]


def test_report_carries_the_policy_entropy(tiny_model_dir, records, tmp_path):
    _, got, _ = _run(tiny_model_dir, records, tmp_path, "one", "R3")
    # Uniform over 512 tokens would be ln 512 = 6.24; a random tiny model is close to it.
    assert all(0.0 < step.entropy <= np.log(512) + 1e-6 for step in got)
    # The report stays JSON, and reads back whole; a figure left out is an error, not a None.
    for step in got:
        data = json.loads(json.dumps(step.as_dict()))
        assert StepReport.from_dict(data) == step
        del data["loss"]
        with pytest.raises(KeyError, match="loss"):
            StepReport.from_dict(data)


@pytest.mark.parametrize(
    ("split", "message"),
    [
        # 4 layers: 3 on the first stage leave 1 for the last; 5 leave -1.
        (["parallel.first_stage_layers=5"], "layers with 5 on the first"),
        (["parallel.pp=3"], "do not divide over pp=3"),
    ],
)
def test_a_layer_split_that_disagrees_with_the_model_fails_on_every_rank(
    split, message, tiny_model_dir, records, tmp_path
):
    import sys

    pp = [] if any(s.startswith("parallel.pp=") for s in split) else ["parallel.pp=2"]
    world = 3 if "parallel.pp=3" in split else 2
    args = [
        sys.executable,
        "-m",
        "trainer",
        f"model.path={tiny_model_dir}",
        f"data.records_file={records}",
        *pp,
        *split,
        "--steps",
        "1",
    ]
    for returncode, _, stderr in run_each_rank(args, world_size=world):
        assert returncode != 0
        assert message in stderr, stderr[-3000:]
