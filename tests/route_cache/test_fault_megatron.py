"""The fault run's real trainer (``benchmarks/faults/fault_megatron.py``): ``python -m
trainer`` on 2 data-parallel gloo ranks under torchrun, on a real route cache's ready feed
over a redis-server, SIGKILLed (with its ranks) at the kill points the fault run uses, and
started again each time, as the fault run's supervisor does.

The oracle is what was sent (``fault_history.expected``: every sample's record, digested) and
the fault run's own checker of the trainer's history (``trainer_steps``): every published
sample in exactly one step the final weights descend from, trained on the record as sent, the
last process finished, nothing pending on the trainer's group.
"""

from __future__ import annotations

import os
import subprocess
import time
import uuid

import pytest

from benchmarks.faults import fault_megatron
from benchmarks.faults.bench_faults import ROOT, kill_tree
from benchmarks.faults.fault_history import (
    TRAINER,
    digest,
    expected,
    first_turn,
    later_turn,
    load_history,
    trainer_steps,
)
from route_cache.config import Config
from route_cache.connection import connect
from route_cache.server import RouteCacheServer
from route_cache.store import RouteStore
from routereplay.rpc.client import RouteCacheClient

pytest.importorskip("megatron.core")
pytest.importorskip("psutil")  # kill_tree; installed with vllm
pytestmark = pytest.mark.slow

SEED, SAMPLES, BATCH = 5, 32, 8  # 4 steps; a checkpoint after the third


@pytest.fixture
def feed(redis_node):
    """A route cache with a ready stream of its own, holding ``SAMPLES`` published samples of
    three turns each; yields (target, stream, redis, sample ids)."""
    client = connect(redis_node.url, cluster=False)
    stream = f"rr:ready:{uuid.uuid4().hex[:8]}"
    config = Config(host="127.0.0.1", port=0, grace_s=1, ready_stream=stream)
    server = RouteCacheServer(config, RouteStore(client, ttl_ms=600_000)).start()
    target = f"127.0.0.1:{server.port}"
    ids = [f"mt-{uuid.uuid4().hex[:6]}-{i}" for i in range(SAMPLES)]
    with RouteCacheClient(target) as writer:
        for sample_id in ids:
            writer.write(first_turn(SEED, sample_id), more_turns=True)
            writer.append(later_turn(SEED, sample_id, 1), final=False)
            writer.append(later_turn(SEED, sample_id, 2), final=True)
    yield target, stream, client, ids
    server.stop(0)
    client.close()


def start(workdir, target: str, t0: float) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    env.pop("WORLD_SIZE", None)
    args = fault_megatron.command(workdir, target, t0, batch=BATCH)
    with open(workdir / "trainer.log", "ab") as log:
        return subprocess.Popen(args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def paused_at(
    workdir, job: subprocess.Popen, life: int, point: str, timeout_s: float = 300
) -> dict:
    """Wait for the lead of the job's ``life``-th process to log ``paused`` at ``point`` (then
    stopped by itself)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        history = load_history([workdir / "trainer.jsonl"])
        resumes = [i for i, e in enumerate(history) if e["op"] == "resume"]
        if len(resumes) == life and history[-1]["op"] == "paused":
            assert history[-1]["point"] == point, history[-1]
            return history[-1]
        log = (workdir / "trainer.log").read_text(errors="replace")
        assert job.poll() is None, f"the job ended ({job.returncode}):\n{log[-4000:]}"
        time.sleep(0.2)
    raise AssertionError(f"no stop at {point}")


def test_the_real_trainer_killed_at_each_point_trains_every_sample_once(feed, tmp_path):
    target, stream, redis_client, ids = feed
    t0 = time.time()
    # A kill mid-step in the first step (no checkpoint yet: the step is discarded), one between
    # the third step's checkpoint and its acknowledgement, one after the fourth's
    # acknowledgement (no checkpoint covers it), then a run to the end.
    for life, point in enumerate(("mid_step", "after_checkpoint", "after_ack"), 1):
        (tmp_path / "pause").mkdir(exist_ok=True)
        (tmp_path / "pause" / point).touch()
        job = start(tmp_path, target, t0)
        paused_at(tmp_path, job, life, point)
        kill_tree(job)
        job.wait(30)
    (tmp_path / "stop").touch()
    job = start(tmp_path, target, t0)
    assert job.wait(300) == 0, (tmp_path / "trainer.log").read_text()[-4000:]

    history = load_history([tmp_path / "trainer.jsonl", tmp_path / "trainer-r1.jsonl"])
    assert {e["proc"] for e in history} == {TRAINER}
    steps = trainer_steps(history)
    assert steps["finished"] and steps["processes"] == 4
    assert steps["discarded"], "the kills discarded no step"
    committed = [
        pair for e in steps["committed"] for pair in zip(e["samples"], e["digests"], strict=True)
    ]
    assert sorted(s for s, _ in committed) == sorted(ids)  # each once, none missing
    assert all(d == digest(expected(SEED, s, 3)) for s, d in committed)
    assert redis_client.xpending(stream, TRAINER)["pending"] == 0
