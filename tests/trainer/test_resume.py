"""A trainer rank SIGKILLed mid-step under torchrun, and the job restarted.

``python -m trainer`` runs 2 data-parallel gloo ranks for 4 R3 steps, fetching its samples
from a real route cache (over a redis-server) by id and checkpointing after every step. In the
faulty run rank 1 is SIGKILLed while step 1 is in progress (after the checkpoint of step 0
appears); torchrun then stops rank 0 and fails. Started again with the same command, the job
resumes from the last checkpoint, fetches the same records for the remaining steps, and ends
with the same weights and the same per-step reports as a run that was never interrupted.

Tolerance: none. Both runs have the same layout, the same reduction order and deterministic CPU
kernels, and a checkpoint restores the parameters, AdamW's moments and step counts, and the
RNG states, so the resumed run repeats the uninterrupted one's arithmetic exactly; any
difference is a resume bug, not rounding.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from route_cache.config import Config
from route_cache.connection import connect
from route_cache.server import RouteCacheServer
from route_cache.store import RouteStore
from routereplay.domain.record_file import load_records
from routereplay.rpc.client import RouteCacheClient
from tests.trainer.helpers import assert_same_step
from trainer.report.step_report import reports_from_json

pytest.importorskip("megatron.core")
psutil = pytest.importorskip("psutil")  # installed with vllm

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow
STEPS = 4


@pytest.fixture(scope="module")
def cache_with_samples(tiny_model_dir, redis_node):
    """A route cache holding 8 rollout samples of the tiny model; yields (target, ids)."""
    from routereplay.dev.hf_rollout import random_prompts, rollout_records

    prompts = random_prompts(2, [5, 8], 512, seed=3)
    records = rollout_records(
        tiny_model_dir, prompts, group_size=4, new_tokens=8, seed=0, prefix=f"resume-{os.getpid()}"
    )
    store = RouteStore(connect(redis_node.url, cluster=False))
    server = RouteCacheServer(Config(host="127.0.0.1", port=0, grace_s=1), store).start()
    target = f"127.0.0.1:{server.port}"
    with RouteCacheClient(target) as client:
        for record in records:
            client.write(record)
    yield target, [r.sample_id for r in records]
    server.stop(0)


def start_job(model_dir, target: str, ids: list[str], out: Path) -> subprocess.Popen:
    """``torchrun --nproc-per-node 2 -m trainer ...`` writing into ``out`` (output to a file)."""
    launcher = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    head = [launcher] if launcher else [sys.executable, "-m", "torch.distributed.run"]
    args = [
        *head,
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "trainer",
        f"model.path={model_dir}",
        f"route_cache.target={target}",
        "router_replay.mode=R3",
        "train.batch_size=4",
        "train.micro_batch_size=2",
        "parallel.dp=2",
        f"train.checkpoint_dir={out / 'ckpt'}",
        "train.checkpoint_every=1",
        f"router_replay.record_file={out / 'used.npz'}",
        "--report",
        str(out / "report.json"),
        "--ids",
        ",".join(ids),
        "--steps",
        str(STEPS),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("WORLD_SIZE", None)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "log.txt", "ab") as log:
        return subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def finish(job: subprocess.Popen, out: Path, timeout_s: float = 300) -> str:
    job.wait(timeout_s)
    log = (out / "log.txt").read_text(errors="replace")
    assert job.returncode == 0, log[-6000:]
    return log


def rank_process(job: subprocess.Popen, rank: int, timeout_s: float = 60) -> psutil.Process:
    """The worker process torchrun started for ``rank`` (found by its RANK variable)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for child in psutil.Process(job.pid).children(recursive=True):
            try:
                if child.environ().get("RANK") == str(rank):
                    return child
            except psutil.Error:
                pass
        time.sleep(0.2)
    raise AssertionError(f"no rank {rank} process under torchrun")


def wait_for(path: Path, job: subprocess.Popen, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert job.poll() is None, f"the job ended before {path.name} appeared"
        assert time.monotonic() < deadline, f"no {path.name}"
        time.sleep(0.01)


def test_rank_killed_mid_step_resumes_to_the_same_result(
    tiny_model_dir, cache_with_samples, tmp_path
):
    target, ids = cache_with_samples
    ref_dir, run_dir = tmp_path / "uninterrupted", tmp_path / "killed"
    finish(start_job(tiny_model_dir, target, ids, ref_dir), ref_dir)

    job = start_job(tiny_model_dir, target, ids, run_dir)
    victim = rank_process(job, 1)
    wait_for(run_dir / "ckpt" / "step_000001.pt", job)  # step 0 done: step 1 is running
    # Frozen at once (a tiny step takes well under a second), so the peers block in its next
    # collective and the job cannot run on to the end before the kill lands.
    victim.send_signal(signal.SIGSTOP)
    victim.send_signal(signal.SIGKILL)
    killed_at = time.monotonic()
    assert job.wait(120) != 0  # torchrun saw the rank die and stopped the job
    print(f"torchrun failed the job {time.monotonic() - killed_at:.1f} s after the kill")
    assert not (run_dir / "ckpt" / f"step_{STEPS:06d}.pt").exists()
    saved = sorted(p.name for p in (run_dir / "ckpt").glob("step_*.pt"))
    resumed_at = int(saved[-1][5:11])
    assert 1 <= resumed_at < STEPS

    log = finish(start_job(tiny_model_dir, target, ids, run_dir), run_dir)
    assert f"({resumed_at} steps done)" in log  # it resumed from its last checkpoint
    print(f"resumed after {resumed_at} of {STEPS} steps")

    ref_reports = reports_from_json(json.loads((ref_dir / "report.json").read_text()))
    reports = reports_from_json(json.loads((run_dir / "report.json").read_text()))
    assert [r.step for r in reports] == list(range(resumed_at, STEPS))
    for got, want in zip(reports, ref_reports[resumed_at:], strict=True):
        assert_same_step(got, want)
        assert got.reward_mean == want.reward_mean

    # The same records were fetched for the resumed steps: ids and routes.
    ref_used, used = load_records(ref_dir / "used.npz"), load_records(run_dir / "used.npz")
    assert len(used) * STEPS == len(ref_used) * (STEPS - resumed_at)
    for got, want in zip(used, ref_used[len(ref_used) - len(used) :], strict=True):
        assert got.sample_id == want.sample_id
        np.testing.assert_array_equal(got.routes, want.routes)

    final = f"step_{STEPS:06d}.pt"
    w_ref = torch.load(ref_dir / "ckpt" / final, weights_only=False)
    w_run = torch.load(run_dir / "ckpt" / final, weights_only=False)
    assert w_ref["model"].keys() == w_run["model"].keys()
    for name, tensor in w_ref["model"].items():
        if torch.is_tensor(tensor):
            assert torch.equal(tensor, w_run["model"][name]), name
