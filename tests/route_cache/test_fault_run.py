"""The fault run (benchmarks/bench_faults.py), and its checker.

The checker is tested on histories with one violation each, against records built from what
the writers send: it must name each. The short run (about 30 s of writes under six faults,
plus start-up and drain) must pass it; the deliberate failure (a consumer that commits without
acknowledging) must fail it, as trained twice.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid

import pytest

from benchmarks.bench_faults import ROOT, FaultConfig, report, run
from benchmarks.fault_history import (
    History,
    check,
    digest,
    expected,
    first_turn,
    later_turn,
    load_history,
)
from route_cache.config import Config
from route_cache.server import RouteCacheServer
from route_cache.store import RouteStore, connect
from routereplay.rpc.client import RouteCacheClient

SEED = 3


def op(t, sample, turn, ok=True, final=False):
    return {
        "t": t,
        "proc": "w",
        "op": "append" if turn else "write",
        "sample": sample,
        "turn": turn,
        "final": final,
        "ok": ok,
        "ms": 1.0,
    }


def published(sample, t=0.0):
    return [op(t, sample, 0), op(t + 1, sample, 1), op(t + 2, sample, 2, final=True)]


def trained(sample, proc="c0", turns=3):
    return [
        {
            "t": 9,
            "proc": proc,
            "op": "train",
            "sample": sample,
            "digest": digest(expected(SEED, sample, turns)),
            "turns": turns,
        },
        {"t": 9, "proc": proc, "op": "ack", "samples": [sample], "ok": True},
    ]


def verdict(history, stored):
    return check(history, SEED, lambda ids: {s: stored.get(s) for s in ids}, turns_per_sample=3)


def test_a_clean_history_passes():
    found = verdict(published("a") + trained("a"), {"a": expected(SEED, "a", 3)})
    assert found.ok, found.lines()


def test_the_checker_names_each_violation():
    whole = {s: expected(SEED, s, 3) for s in "abcdef"}
    history = []
    for s in "abcdef":
        history += published(s)
    history += trained("a") + trained("a", proc="c1")  # trained twice
    history += trained("c", turns=2)[:1] + trained("c")[1:]  # trained on 2 of 3 turns
    history += trained("d")[:1]  # trained, never acknowledged
    # "e" is published and never trained; "b" is lost: its record has only turn 0.
    history += trained("b") + trained("f")
    stored = {**whole, "b": expected(SEED, "b", 1)}
    found = verdict(history, stored)
    assert not found.ok
    assert found.trained_twice == ["a"]
    assert found.trained_wrong == ["c"]
    assert found.trained_unacked == ["d"]
    assert found.never_trained == ["e"]
    assert found.lost == ["b"]


def test_half_written_and_unacknowledged_turns():
    # "x": turn 2 failed (never acknowledged) yet landed whole: allowed. "y": its record holds
    # turn 1 twice (a retried append written again): half-written. "z": never acknowledged,
    # but a record with other bytes: half-written.
    history = published("x")[:2] + [op(2, "x", 2, ok=False, final=True)]
    history += published("y")[:2] + [op(5, "z", 0, ok=False)]
    y = expected(SEED, "y", 2)
    y.token_ids = y.token_ids[:-1]  # a different record than sent
    stored = {"x": expected(SEED, "x", 3), "y": y, "z": expected(SEED, "y", 1)}
    found = verdict(history, stored)
    assert found.half_written == ["y", "z"] and not found.lost


@pytest.mark.slow
def test_short_fault_run_passes_the_checker(tmp_path):
    results = run(FaultConfig(duration_s=24.0, short=True), tmp_path)
    print(report(results))
    assert results["verdict"], "\n".join(results["verdict_lines"])
    assert results["counts"]["faults"] == 6
    assert results["counts"]["samples published (final turn acknowledged)"] > 20
    assert all("error" not in f["detail"] for f in results["faults"]), results["faults"]
    assert results["availability"] >= 0.97, results["failed_by_status"]


@pytest.mark.parametrize("drop_ack", [False, True])
def test_the_checker_catches_a_dropped_acknowledgement(redis_node, tmp_path, drop_ack):
    """The two consumer processes of the run over one route cache, without faults: clean,
    they pass; with ``--drop-ack-step 1`` (consumer c1 commits its first step without
    acknowledging it), c0 claims those samples once idle and trains them again."""
    stream = f"rr:ready:{uuid.uuid4().hex[:8]}"
    config = Config(host="127.0.0.1", port=0, grace_s=0, ready_stream=stream)
    server = RouteCacheServer(config, RouteStore(connect(redis_node.url, False))).start()
    target, start = f"127.0.0.1:{server.port}", time.time()
    history = History(tmp_path / "writer.jsonl", "writer", start)
    prefix = uuid.uuid4().hex[:6]
    consumers = []
    try:
        with RouteCacheClient(target, timeout_s=10) as client:
            for i in range(8):  # published before the consumers start: c1 takes some
                sample_id = f"{prefix}-{i}"
                client.write(first_turn(SEED, sample_id), more_turns=True)
                history.log("write", sample=sample_id, turn=0, final=False, ok=True, ms=1)
                for turn in (1, 2):
                    client.append(later_turn(SEED, sample_id, turn), final=turn == 2)
                    history.log(
                        "append", sample=sample_id, turn=turn, final=turn == 2, ok=True, ms=1
                    )
            for name in ("c1", "c0"):  # c1 first: it reads all 8 entries, c0 can only claim
                args = [
                    sys.executable,
                    str(ROOT / "benchmarks" / "fault_consumer.py"),
                    "--target",
                    target,
                    "--name",
                    name,
                    "--group",
                    stream,
                    "--history",
                    str(tmp_path / f"{name}.jsonl"),
                    "--start",
                    repr(start),
                    "--stop-file",
                    str(tmp_path / "stop"),
                    # Only c0 claims: c1, polling too, could otherwise take back its own
                    # unacknowledged entries each time they turn idle, before c0 does, until
                    # c0's drain ends (a race the CI lost once).
                    "--claim-idle-ms",
                    "500" if name == "c0" else "600000",
                    "--batch",
                    "2",
                    "--drain-idle-s",
                    "3",
                ]
                if drop_ack and name == "c1":
                    args += ["--drop-ack-step", "1"]
                consumers.append(subprocess.Popen(args))
                deadline = time.monotonic() + 30
                while (
                    name == "c1"
                    and sum(  # c1 has trained all 8 (one step dropped or not)
                        e["op"] == "train" for e in load_history([tmp_path / "c1.jsonl"])
                    )
                    < 8
                ):
                    assert time.monotonic() < deadline, "c1 did not train the samples"
                    time.sleep(0.1)
            (tmp_path / "stop").touch()
            for proc in consumers:
                assert proc.wait(30) == 0
            entries = load_history(tmp_path.glob("*.jsonl"))
            stored = {
                s: r for s in [f"{prefix}-{i}" for i in range(8)] for r in client.read_batch([s])
            }
    finally:
        for proc in consumers:
            proc.kill()
        server.stop(0)
    found = check(entries, SEED, lambda ids: {s: stored.get(s) for s in ids}, 3)
    if not drop_ack:
        assert found.ok, found.lines()
        return
    dropped = next(e["samples"] for e in entries if e["op"] == "dropped_ack")
    assert found.trained_twice == sorted(dropped), "\n".join(found.lines())
    assert not (found.lost or found.never_trained or found.half_written)
