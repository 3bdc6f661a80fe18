"""The Hugging Face checkpoint loaded into a parallel layout gives transformers' numbers.

Each layout runs ``tests/trainer/sharded_worker.py`` on every rank under torchrun (gloo): every
rank loads only its share of the weights (``trainer.model.shard_weights``), the model runs 4 samples
through megatron's schedule, and rank 0 compares the logits (gathered over TP, from the last
pipeline stage) and the natural top-k of every MoE layer with transformers running each sample
alone. Same tolerance as the single-rank parity test (tests/trainer/model/test_model_parity.py):
max |logit difference| <= 1e-5, argmax equal, top-k expert set equal on 100% of tokens.

Then ``python -m trainer``'s RL steps under TP2 + SP and EP2 against one rank (below).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from routereplay.domain.record_file import load_records, save_records
from tests.trainer.helpers import assert_same_counts, assert_same_step
from tests.trainer.model.test_model_parity import LOGIT_ATOL
from tests.trainer.parallel.test_dp_train import records  # noqa: F401 (fixture)
from tests.trainer.parallel.test_multirank import _torchrun, tiny8_model_dir  # noqa: F401 (fixture)
from tests.trainer.ranks import run_each_rank
from tests.trainer.tolerance import LAYOUT_LOSS_ATOL
from trainer.model.shard_weights import tp_slice
from trainer.report.step_report import StepReport, reports_from_json

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


def _run_worker(layout: str, model_dir, out, nproc: int = 2) -> dict:
    proc = _torchrun(
        layout, model_dir, out, timeout=180, nproc=nproc, module="tests.trainer.sharded_worker"
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(Path(out).read_text())


def _check(result: dict, logit_ranks: int) -> None:
    assert result["ranks_with_logits"] == logit_ranks
    assert result["max_dlogit"] <= LOGIT_ATOL, result
    assert result["argmax_equal"], result
    # Every MoE layer seen on some rank, on every real token.
    assert [int(layer) for layer in result["layers"]] == result["hf_moe_layers"], result
    assert not any(result["mismatched_tokens"].values()), result
    # The shares gathered back (shard_weights.full_weights) are the checkpoint, bit for bit.
    assert result["gathered_equal"] and result["gathered_complete"], result
    print(f"{result['layout']}: max |dlogit| {result['max_dlogit']:.2e}")


@pytest.mark.parametrize(
    ("layout", "logit_ranks"),
    # TP ranks each gather the full logits; EP2 is two data-parallel ranks; PP: the last stage.
    [("tp2sp", 2), ("ep2", 2), ("tp2sp_ep2", 2), ("pp2", 1)],
)
def test_a_sharded_checkpoint_matches_transformers(layout, logit_ranks, tiny_model_dir, tmp_path):
    _check(_run_worker(layout, tiny_model_dir, tmp_path / "result.json"), logit_ranks)


def test_virtual_stage_chunks_match_transformers(tiny8_model_dir, tmp_path):  # noqa: F811
    """PP2 x VP2: 4 chunks of 2 layers of the 8-layer model, interleaved schedule."""
    _check(_run_worker("pp2_vp2", tiny8_model_dir, tmp_path / "result.json"), 1)


def test_four_ranks_tp2_pp2_match_transformers(tiny_model_dir, tmp_path):
    """TP2 + SP x PP2 on 4 ranks: the last stage's 2 TP ranks hold logits."""
    _check(_run_worker("tp2sp_pp2", tiny_model_dir, tmp_path / "result.json", nproc=4), 2)


def test_gated_fc1_splits_gate_and_up_each():
    """fc1 = [gate; up]: TP rank r holds [gate slice r; up slice r], not a half of the rows."""
    gate = torch.arange(8.0)[:, None].repeat(1, 3)
    up = 100 + gate
    full = torch.cat([gate, up])
    got = [tp_slice(full, 0, r, 2, gated=True) for r in range(2)]
    assert torch.equal(got[0], torch.cat([gate[:4], up[:4]]))
    assert torch.equal(got[1], torch.cat([gate[4:], up[4:]]))
    # Row-parallel (fc2, linear_proj): columns; replicated parameters: the whole tensor.
    assert torch.equal(tp_slice(full, 1, 2, 3, gated=False), full[:, 2:])
    assert tp_slice(full, None, 1, 2, gated=False) is full


# ``python -m trainer`` under tensor and expert parallelism: the same RL steps as one rank.
# Against one rank only the float summation order differs (row-parallel partial sums, the
# sequence-parallel gradients summed over 2 ranks): measured |d loss| <= 9e-9, |d expected
# reward| 7e-9, |d gap mean| 4.5e-8. Leaving the TP gradient sum of the sequence-parallel norms,
# routers and q/k norms out moved step 0's loss by 3.6e-6 and step 1's gap mean by 5e-4;
# summing expert gradients over the DP group under EP2 moved them by 4e-4 and 6e-3.
# The loss's bound, 2.74e-6, is derived in tests/trainer/tolerance.py (2 float32 spacings of a
# log-prob plus N - 1 roundings of the mini-batch's sum); the expected reward, a mean of
# probabilities below 1 over the same tokens from the same logits, is held to it too.
LOSS_ATOL = LAYOUT_LOSS_ATOL
# The gap's mean |logp - rollout logp| moves by at most the log-probs' 2 spacings (9.5e-7) on
# step 0; step 1 runs on weights 4 AdamW steps apart (no ratio divides that out): measured up
# to 2.2e-6 (PP2 x VP2, AVX2 kernels). Faults above moved it by 5e-4 and 6e-3.
GAP_ATOL = 1e-5
# The exported weights after those 2 steps (8 AdamW steps): measured mean |diff| <= 8.4e-9, max
# 9.5e-5 (AdamW divides by sqrt(v): rounding noise on a near-zero gradient entry becomes a step
# of up to lr = 1e-3); training moved them by 2.8e-3 on average.
WEIGHT_ATOL = 1e-3
WEIGHT_MEAN_ATOL = 1e-7
_TP2SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]
RL_LAYOUTS = {  # name: (ranks, overrides)
    "tp2sp": (2, _TP2SP),
    "ep2": (2, ["parallel.ep=2"]),
    # DP2 x TP2 + SP, experts over EP2 (expert TP 1): every kind of gradient sum at once.
    "dp2_tp2sp_ep2": (4, [*_TP2SP, "parallel.ep=2", "parallel.etp=1"]),
}


def _trainer(
    model_dir,
    records_file,
    report: Path,
    mode: str,
    *extra: str,
    nproc: int = 1,
    steps: int = 2,
    timeout: float = 240,
) -> tuple[subprocess.CompletedProcess, list[StepReport]]:
    """``python -m trainer`` (under torchrun with ``nproc`` > 1), exporting every step to
    ``export/`` beside ``report``."""
    args = [
        "-m",
        "trainer",
        f"model.path={model_dir}",
        f"data.records_file={records_file}",
        f"router_replay.mode={mode}",
        "train.batch_size=4",
        "train.micro_batch_size=2",
        "train.lr=1e-3",
        f"train.export_dir={report.parent / 'export'}",
        *extra,
        "--steps",
        str(steps),
        "--report",
        str(report),
    ]
    head = [sys.executable]
    if nproc > 1:
        launcher = shutil.which("torchrun", path=str(Path(sys.executable).parent))
        head = [launcher] if launcher else [sys.executable, "-m", "torch.distributed.run"]
        head += ["--standalone", "--nproc-per-node", str(nproc)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run(
        [*head, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc, reports_from_json(json.loads(report.read_text()))


def _exported(run_dir: Path) -> dict[str, torch.Tensor]:
    """The weights of the newest export of the run writing into ``run_dir``."""
    from safetensors.torch import load_file

    export = run_dir / "export"
    return load_file(export / (export / "latest").read_text().strip() / "model.safetensors")


@pytest.fixture(scope="module")
def unequal_records(records, tmp_path_factory):  # noqa: F811
    """The 4 samples of ``records`` (13, 13, 16, 16 tokens, GRPO groups of 2) reordered 13, 16,
    13, 16: with 2 samples per micro-batch over DP2, the two DP ranks of a micro-batch (the two
    ranks of the EP group under EP2) hold 13 and 16 tokens and dispatch unequal token counts,
    as real batches do. The allgather dispatcher crashed on it (gloo size mismatch)."""
    recs = load_records(records)
    assert [r.token_ids.size for r in recs] == [13, 13, 16, 16]
    return save_records(
        tmp_path_factory.mktemp("unequal") / "rollout.npz", [recs[0], recs[2], recs[1], recs[3]]
    )


@pytest.fixture(scope="module")
def one_rank(tiny_model_dir, unequal_records, tmp_path_factory):
    """Per mode, 2 steps on one rank (lr 1e-3: step 1 runs on weights step 0 moved) on
    ``unequal_records``: the reports and the folder the run wrote into."""
    runs: dict[str, tuple[list[StepReport], Path]] = {}

    def get(mode: str) -> tuple[list[StepReport], Path]:
        if mode not in runs:
            report = tmp_path_factory.mktemp("one") / "r.json"
            runs[mode] = (
                _trainer(tiny_model_dir, unequal_records, report, mode)[1],
                report.parent,
            )
        return runs[mode]

    return get


# R2 under TP records from the gathered natural top-k instead of megatron's RECORD.
@pytest.mark.parametrize(
    ("layout", "mode"),
    [("tp2sp", "R3"), ("tp2sp", "R2"), ("ep2", "R3"), ("dp2_tp2sp_ep2", "R3")],
)
def test_rl_steps_under_tp_and_ep_equal_one_rank(
    layout,
    mode,
    tiny_model_dir,
    unequal_records,
    one_rank,
    tmp_path,
):
    nproc, extra = RL_LAYOUTS[layout]
    proc, got = _trainer(
        tiny_model_dir, unequal_records, tmp_path / "r.json", mode, *extra, nproc=nproc
    )
    assert proc.stdout.count(f"step 1 [{mode}]") == 1, proc.stdout[-3000:]  # one rank logs
    reference, reference_dir = one_rank(mode)
    assert len(got) == len(reference) == 2
    for ref, step in zip(reference, got, strict=True):
        assert_same_counts(step, ref)
        # R3: every rank's routed rows, summed, followed the rollout's routes as on one rank.
        assert step.replay_followed == ref.replay_followed
        assert step.loss == pytest.approx(ref.loss, abs=LOSS_ATOL)
        assert step.expected_reward == pytest.approx(ref.expected_reward, abs=LOSS_ATOL)
        for name, gap in ref.gap.items():
            assert step.gap[name].mean_abs == pytest.approx(gap.mean_abs, abs=GAP_ATOL)
    # Step 1 trains on weights step 0 changed: its gap to the rollout is far from step 0's.
    assert got[1].gap["replayed"].mean_abs > 100 * GAP_ATOL
    _check_export(tmp_path, reference_dir, tiny_model_dir, layout)


def _check_export(run_dir: Path, reference_dir: Path, model_dir, layout: str) -> None:
    """The lead's export (the shards gathered by every rank) against one rank's: every tensor,
    its shape and dtype, and values within float summation noise of the same 2 steps."""
    from trainer.model.hf_weights import load_hf_state_dict

    ours, theirs = _exported(run_dir), _exported(reference_dir)
    assert ours.keys() == theirs.keys()
    for name, tensor in ours.items():
        assert (tensor.shape, tensor.dtype) == (theirs[name].shape, theirs[name].dtype), name
    source = load_hf_state_dict(model_dir)
    diff = torch.cat([(t - theirs[n]).abs().flatten() for n, t in ours.items()])
    moved = torch.cat([(t - source[n]).abs().flatten() for n, t in theirs.items()])
    print(
        f"{layout}: export |diff| mean {diff.mean():.2e} max {diff.max():.2e}; "
        f"training moved weights by mean {moved.mean():.2e} max {moved.max():.2e}"
    )
    assert diff.max() <= WEIGHT_ATOL and diff.mean() <= WEIGHT_MEAN_ATOL
    # Trained weights, not the source's: a weight in the wrong place would be far off.
    assert moved.mean() > 100 * WEIGHT_MEAN_ATOL


@pytest.mark.parametrize(
    "layout",
    [[*_TP2SP, "parallel.ep=2", "parallel.etp=1"], ["parallel.pp=2"]],
    ids=["tp2sp_ep2", "pp2"],
)
def test_model_parallel_checkpoints_resume_to_the_same_weights(
    layout,
    tiny_model_dir,
    records,  # noqa: F811
    tmp_path,
):
    """TP2 + SP with experts over EP2, or 2 pipeline stages, on 2 ranks, each rank
    checkpointing its own shard: one step, then the job started again for a second, ends as 2
    steps without a stop, bit for bit (same layout, same arithmetic: any difference is a resume
    bug)."""
    extra = [*layout, "train.checkpoint_every=1"]
    whole, split = tmp_path / "whole", tmp_path / "split"
    runs = {}
    for folder, steps in ((whole, 2), (split, 1), (split, 2)):
        folder.mkdir(exist_ok=True)
        runs[folder] = _trainer(
            tiny_model_dir,
            records,
            folder / "r.json",
            "R3",
            *extra,
            f"train.checkpoint_dir={folder / 'ckpt'}",
            nproc=2,
            steps=steps,
        )
    proc, got = runs[split]
    assert proc.stdout.count("(1 steps done)") == 1, proc.stdout[-3000:]
    want = runs[whole][1]
    assert [r.step for r in got] == [1]
    assert_same_step(got[0], want[1])
    assert got[0].update_agreement == want[1].update_agreement

    names = sorted(p.name for p in (whole / "ckpt").glob("step_000002.*.pt"))
    assert len(names) == 2 and names[0] != names[1], names  # one file per rank
    assert (whole / "ckpt" / "latest").read_text().strip() == "step_000002"
    for name in names:
        a = torch.load(whole / "ckpt" / name, weights_only=False)
        b = torch.load(split / "ckpt" / name, weights_only=False)
        assert a["model"].keys() == b["model"].keys()
        for key, tensor in a["model"].items():
            assert torch.equal(tensor, b["model"][key]), (name, key)
        moments = b["optimizer"]["inner"]["state"]
        for param, state in a["optimizer"]["inner"]["state"].items():
            for key, value in state.items():
                assert torch.equal(torch.as_tensor(value), torch.as_tensor(moments[param][key]))
    ours, theirs = _exported(split), _exported(whole)
    assert all(torch.equal(t, theirs[n]) for n, t in ours.items())


def test_context_parallel_without_transformer_engine_is_refused_on_every_rank(
    tiny_model_dir,
    records,  # noqa: F811
):
    args = [
        sys.executable,
        "-m",
        "trainer",
        f"model.path={tiny_model_dir}",
        f"data.records_file={records}",
        "parallel.cp=2",
        "--steps",
        "1",
    ]
    for returncode, _, stderr in run_each_rank(args):
        assert returncode != 0
        assert "context parallel needs TransformerEngine attention" in stderr, stderr[-3000:]
