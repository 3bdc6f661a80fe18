"""``python -m trainer`` data parallel under torchrun: 2 gloo ranks against one rank.

Both runs train one R3 step (2 micro-batches of 2 samples, 2 PPO epochs: 4 optimizer steps)
on the same 4 rollout samples from the same checkpoint. Each DP rank trains one sample of each
micro-batch; gradients are summed over the ranks with the loss normalised by the global token
count. The weights after the step (the checkpoint DP rank 0 writes) equal the single-rank ones
within float tolerance (not bit-identical: the summation order differs, and each rank pads
its own samples), and the report's routing agreement and reward are identical.
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

from routereplay.domain.record_file import save_records
from tests.trainer.ranks import run_each_rank
from tests.trainer.tolerance import LAYOUT_LOSS_ATOL
from trainer.report.step_report import reports_from_json

pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.slow
# AdamW divides by sqrt(v): on gradient entries near zero, rounding noise (summation order)
# becomes a step of up to lr. Measured: mean |diff| 8e-11 over 1M weights, 4 entries above 1e-6,
# max 4.1e-6, against lr x 4 optimizer steps = 4e-4 for any entry.
WEIGHT_MEAN_ATOL = 1e-9
WEIGHT_MAX_ATOL = 0.05 * 1e-4 * 4


def _run(cmd: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("WORLD_SIZE", None)
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _trainer_args(model_dir, records, out: Path, *extra) -> list[str]:
    return [
        "-m",
        "trainer",
        f"model.path={model_dir}",
        f"data.records_file={records}",
        "router_replay.mode=R3",
        "train.batch_size=4",
        "train.micro_batch_size=2",
        f"train.checkpoint_dir={out / 'ckpt'}",
        f"router_replay.record_file={out / 'used.npz'}",
        *extra,
        "--report",
        str(out / "report.json"),
        "--steps",
        "1",
    ]


@pytest.fixture(scope="module")
def records(tiny_model_dir, tmp_path_factory):
    from routereplay.dev.hf_rollout import random_prompts, rollout_records

    prompts = random_prompts(2, [5, 8], 512, seed=3)
    recs = rollout_records(tiny_model_dir, prompts, group_size=2, new_tokens=8, seed=0)
    return save_records(tmp_path_factory.mktemp("dp") / "rollout.npz", recs)


def test_dp2_step_equals_one_rank(tiny_model_dir, records, tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    single = _run([sys.executable, *_trainer_args(tiny_model_dir, records, one)])
    assert single.returncode == 0, single.stdout[-3000:] + single.stderr[-3000:]
    launcher = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    head = [launcher] if launcher else [sys.executable, "-m", "torch.distributed.run"]
    head += ["--standalone", "--nproc-per-node", "2"]
    args = _trainer_args(tiny_model_dir, records, two, "parallel.dp=2")
    dp = _run([*head, *args])
    assert dp.returncode == 0, dp.stdout[-3000:] + dp.stderr[-6000:]
    # Only DP rank 0 logs the step line.
    assert dp.stdout.count("step 0 [R3]") == 1, dp.stdout[-3000:]

    (ref,) = reports_from_json(json.loads((one / "report.json").read_text()))
    (got,) = reports_from_json(json.loads((two / "report.json").read_text()))
    assert got.agreement == ref.agreement
    assert got.reward_mean == ref.reward_mean
    assert got.rows == ref.rows
    assert got.replay_followed == ref.replay_followed
    assert got.replay_followed.exact == [1.0, 1.0, 1.0]
    assert got.samples == ref.samples == 4
    assert got.update_agreement == ref.update_agreement
    # The bound derived in tests/trainer/tolerance.py (the layouts' steps: 2.74e-6).
    assert got.loss == pytest.approx(ref.loss, abs=LAYOUT_LOSS_ATOL)
    assert got.expected_reward == pytest.approx(ref.expected_reward, abs=LAYOUT_LOSS_ATOL)
    for name, gap in ref.gap.items():
        assert got.gap[name].tokens == gap.tokens
        assert got.gap[name].mean_abs == pytest.approx(gap.mean_abs, abs=1e-5)

    w1 = torch.load(next((one / "ckpt").glob("step_*.pt")), weights_only=False)["model"]
    w2 = torch.load(next((two / "ckpt").glob("step_*.pt")), weights_only=False)["model"]
    assert w1.keys() == w2.keys()
    floats = [k for k in w1 if torch.is_tensor(w1[k]) and w1[k].is_floating_point()]
    diff = torch.cat([(w1[k].float() - w2[k].float()).abs().reshape(-1) for k in floats])
    assert float(diff.mean()) <= WEIGHT_MEAN_ATOL, float(diff.mean())
    assert float(diff.max()) <= WEIGHT_MAX_ATOL, float(diff.max())
    assert (two / "used.npz").exists()


def test_dp_size_that_disagrees_with_the_world_is_refused(tiny_model_dir, records, tmp_path):
    args = [sys.executable, *_trainer_args(tiny_model_dir, records, tmp_path, "parallel.dp=4")]
    for returncode, _, stderr in run_each_rank(args):
        assert returncode != 0
        assert "parallel.dp=4 but world size 2 leaves 2" in stderr, stderr[-3000:]
