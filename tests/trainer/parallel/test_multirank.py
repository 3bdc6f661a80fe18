"""Router replay on real gloo process groups: 2 or 4 ranks per layout, launched with torchrun.

Each layout runs ``tests/trainer/multirank_worker.py`` on every rank (see its docstring for the
checks); rank 0 writes the outcome as JSON. About 15-30 s per 2-rank layout on 2 cores, most of
it importing megatron-core in every process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.trainer.ranks import run_each_rank

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny8_model_dir(tmp_path_factory):
    """The tiny model with 8 layers (dense layer 0): 2 layers per chunk for PP2 x VP2."""
    from routereplay.dev.tiny_model import build_tiny_model
    from routereplay.families.base import TINY_SIZE

    size = dataclasses.replace(TINY_SIZE, num_hidden_layers=8)
    return build_tiny_model(tmp_path_factory.mktemp("tiny8"), seed=0, size=size)


def _torchrun(
    layout,
    model_dir,
    out,
    timeout: float = 120,
    env=None,
    nproc: int = 2,
    module: str = "tests.trainer.multirank_worker",
):
    """``torchrun --nproc-per-node nproc -m module --layout ... --model-dir ... --out ...``."""
    launcher = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    cmd = [launcher] if launcher else [sys.executable, "-m", "torch.distributed.run"]
    cmd += [
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "-m",
        module,
        "--layout",
        layout,
        "--model-dir",
        str(model_dir),
        "--out",
        str(out),
    ]
    run_env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run(
        cmd, cwd=ROOT, env=run_env, capture_output=True, text=True, timeout=timeout
    )


@pytest.mark.parametrize("layout", ["dp2", "tp2sp", "ep2", "ep2_alltoall", "tp2sp_ep2"])
def test_every_rank_replays_its_own_share(layout, tiny_model_dir, tmp_path):
    out = tmp_path / "result.json"
    proc = _torchrun(layout, tiny_model_dir, out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(out.read_text())
    checks = result["checks"]
    assert result["world_size"] == 2
    assert checks["natural_bit_identical"], "replaying natural routes changed loss or grads"
    assert checks["router_grads_nonzero"]
    forced = checks["forced_maps"]
    assert forced["ok"], forced
    assert forced["layers"] == [1, 2, 3]
    # 4 samples of 9, 6, 12 and 7 tokens: one replayed row per token but the last, per layer.
    assert forced["rows_compared"] == 3 * (8 + 5 + 11 + 6)
    if "tp1_loss" in checks:
        # Measured 4.8e-7 for TP2+SP (vocab-parallel cross-entropy sums in another order) and
        # 0.0 for TP2+SP+EP2.
        assert checks["tp_loss_diff"] <= 1e-5, checks


def test_a_world_that_does_not_divide_is_refused_on_every_rank(tiny_model_dir, tmp_path):
    args = [
        sys.executable,
        "-m",
        "tests.trainer.multirank_worker",
        "--layout",
        "bad_tp4",
        "--model-dir",
        str(tiny_model_dir),
        "--out",
        str(tmp_path / "result.json"),
    ]
    # Each rank on its own raises the error before any collective (no hang: the timeout holds).
    for returncode, _, stderr in run_each_rank(args):
        assert returncode != 0
        assert "world size 2 is not divisible by tp x cp x pp" in stderr, stderr[-4000:]


@pytest.mark.parametrize("layout", ["pp2", "pp2_recompute"])
def test_pipeline_stages_replay_their_own_routers_under_1f1b(layout, tiny_model_dir, tmp_path):
    """PP2, megatron's 1F1B schedule, 2 micro-batches (tests/trainer/multirank_pp.py)."""
    out = tmp_path / "result.json"
    proc = _torchrun(layout, tiny_model_dir, out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    checks = json.loads(out.read_text())["checks"]
    # megatron's even split of 4 layers: stage 0 owns layers 0-1, stage 1 layers 2-3.
    assert checks["stage_layers"] == {"0": [1], "1": [2, 3]}
    assert checks["natural_bit_identical"], "replaying natural routes changed loss or grads"
    assert checks["router_grads_nonzero"]
    forced = checks["forced_maps"]
    assert forced["ok"], forced
    assert forced["layers"] == [1, 2, 3]
    # Every router call (forward, and its recompute in backward) on its micro-batch's rows.
    calls = 2 if layout == "pp2_recompute" else 1
    assert forced["rows_compared"] == calls * 3 * (8 + 5 + 11 + 6)
    if layout == "pp2_recompute":
        # REPLAY_FORWARD left on through backward: stage 0 recomputes micro-batch 0 after
        # micro-batch 1's forward and replays 1's ids (stage 1 runs F0 B0 F1 B1: right by luck).
        assert checks["trap_grads_differ"] == {"0": True, "1": False}, checks


@pytest.mark.parametrize("layout", ["pp2_vp2", "pp2_vp2_recompute"])
def test_virtual_stages_replay_each_chunks_routers(layout, tiny8_model_dir, tmp_path):
    """PP2 x 2 virtual stages under megatron's interleaved 1F1B, 2 micro-batches."""
    out = tmp_path / "result.json"
    proc = _torchrun(layout, tiny8_model_dir, out)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    checks = json.loads(out.read_text())["checks"]
    assert checks["schedule"] == "forward_backward_pipelining_with_interleaving"
    # 8 layers over 4 chunks, in megatron's order (vp 0: pp 0, 1; vp 1: pp 0, 1); layer 0 is
    # dense. Rank 0's MoE layers are not consecutive record columns.
    assert checks["chunk_layers"] == {"0/0": [1], "1/0": [2, 3], "0/1": [4, 5], "1/1": [6, 7]}
    assert checks["stage_layers"] == {"0": [1, 4, 5], "1": [2, 3, 6, 7]}
    assert checks["natural_bit_identical"], "replaying natural routes changed loss or grads"
    assert checks["router_grads_nonzero"]
    forced = checks["forced_maps"]
    assert forced["ok"], forced
    assert forced["layers"] == [1, 2, 3, 4, 5, 6, 7]
    calls = 2 if layout == "pp2_vp2_recompute" else 1
    assert forced["rows_compared"] == calls * 7 * (8 + 5 + 11 + 6)
    if layout == "pp2_vp2_recompute":
        # REPLAY_FORWARD left on through backward: with two chunks every stage runs another
        # micro-batch's forward on a chunk before that chunk's first backward.
        assert checks["trap_grads_differ"] == {"0": True, "1": True}, checks


def test_four_ranks_dp2_tp2sp_ep2(tiny_model_dir, tmp_path):
    """4 ranks: DP2 x TP2 + SP, experts over EP2 (expert TP 1), one forward/backward each."""
    out = tmp_path / "result.json"
    proc = _torchrun("dp2_tp2sp_ep2", tiny_model_dir, out, timeout=300, nproc=4)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    result = json.loads(out.read_text())
    assert (result["world_size"], result["dp_size"], result["ep_size"]) == (4, 2, 2)
    checks = result["checks"]
    assert checks["natural_bit_identical"], "replaying natural routes changed loss or grads"
    assert checks["router_grads_nonzero"]
    forced = checks["forced_maps"]
    assert forced["ok"], forced
    # Both DP ranks' samples, each put back together from its two SP shards.
    assert forced["rows_compared"] == 3 * (8 + 5 + 11 + 6)
    assert checks["tp_loss_diff"] <= 1e-5, checks  # measured 0.0


@pytest.mark.parametrize(
    ("layout", "chunk_layers"),
    [
        ("tp2sp_pp2", {"0/0": [1], "1/0": [2, 3]}),
        ("tp2sp_pp2_vp2_recompute", {"0/0": [1], "1/0": [2, 3], "0/1": [4, 5], "1/1": [6, 7]}),
    ],
)
def test_four_ranks_tp2sp_pp2(layout, chunk_layers, tiny_model_dir, tiny8_model_dir, tmp_path):
    """4 ranks: TP2 + SP inside each of 2 pipeline stages (1F1B; interleaved with recompute)."""
    virtual = "vp2" in layout
    out = tmp_path / "result.json"
    model_dir = tiny8_model_dir if virtual else tiny_model_dir
    proc = _torchrun(layout, model_dir, out, timeout=300, nproc=4)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    checks = json.loads(out.read_text())["checks"]
    interleaved = "with_interleaving" if virtual else "without_interleaving"
    assert checks["schedule"] == f"forward_backward_pipelining_{interleaved}"
    assert checks["chunk_layers"] == chunk_layers
    assert checks["natural_bit_identical"], "replaying natural routes changed loss or grads"
    assert checks["router_grads_nonzero"]
    forced = checks["forced_maps"]
    assert forced["ok"], forced
    layers = sorted(layer for ls in chunk_layers.values() for layer in ls)
    assert forced["layers"] == layers
    calls = 2 if virtual else 1  # the recompute's router calls are compared too
    # Every call's two SP shards, concatenated, against the unsharded expectation.
    assert forced["rows_compared"] == calls * len(layers) * (8 + 5 + 11 + 6)
    if virtual:
        assert checks["trap_grads_differ"] == {"0": True, "1": True}, checks
