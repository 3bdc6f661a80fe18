"""The Hugging Face checkpoint loaded into a parallel layout gives transformers' numbers.

Each layout runs ``tests/trainer/sharded_worker.py`` on every rank under torchrun (gloo): every
rank loads only its share of the weights (``trainer.shard_weights``), the model runs 4 samples
through megatron's schedule, and rank 0 compares the logits (gathered over TP, from the last
pipeline stage) and the natural top-k of every MoE layer with transformers running each sample
alone. Same tolerance as the single-rank parity test (tests/trainer/test_model_parity.py):
max |logit difference| <= 1e-5, argmax equal, top-k expert set equal on 100% of tokens.
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

from tests.trainer.test_model_parity import LOGIT_ATOL
from tests.trainer.test_multirank import tiny8_model_dir  # noqa: F401 (fixture)
from trainer.shard_weights import tp_slice

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _torchrun(layout: str, model_dir, out, nproc: int = 2, timeout: float = 180):
    launcher = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    cmd = [launcher] if launcher else [sys.executable, "-m", "torch.distributed.run"]
    cmd += ["--standalone", "--nproc-per-node", str(nproc), "-m", "tests.trainer.sharded_worker",
            "--layout", layout, "--model-dir", str(model_dir), "--out", str(out)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(Path(out).read_text())


def _check(result: dict, logit_ranks: int) -> None:
    assert result["ranks_with_logits"] == logit_ranks
    assert result["max_dlogit"] <= LOGIT_ATOL, result
    assert result["argmax_equal"], result
    # Every MoE layer seen on some rank, on every real token.
    assert [int(layer) for layer in result["layers"]] == result["hf_moe_layers"], result
    assert not any(result["mismatched_tokens"].values()), result
    print(f"{result['layout']}: max |dlogit| {result['max_dlogit']:.2e}")


@pytest.mark.parametrize(
    ("layout", "logit_ranks"),
    # TP ranks each gather the full logits; EP2 is two data-parallel ranks; PP: the last stage.
    [("tp2sp", 2), ("ep2", 2), ("tp2sp_ep2", 2), ("pp2", 1)],
)
def test_a_sharded_checkpoint_matches_transformers(layout, logit_ranks, tiny_model_dir, tmp_path):
    _check(_torchrun(layout, tiny_model_dir, tmp_path / "result.json"), logit_ranks)


def test_virtual_stage_chunks_match_transformers(tiny8_model_dir, tmp_path):  # noqa: F811
    """PP2 x VP2: 4 chunks of 2 layers of the 8-layer model, interleaved schedule."""
    _check(_torchrun("pp2_vp2", tiny8_model_dir, tmp_path / "result.json"), 1)


def test_four_ranks_tp2_pp2_match_transformers(tiny_model_dir, tmp_path):
    """TP2 + SP x PP2 on 4 ranks: the last stage's 2 TP ranks hold logits."""
    _check(_torchrun("tp2sp_pp2", tiny_model_dir, tmp_path / "result.json", nproc=4), 2)


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
