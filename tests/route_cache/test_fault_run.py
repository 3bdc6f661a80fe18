"""The fault run (benchmarks/faults/bench_faults.py), and its checker.

The checker is tested on histories with one violation each, against records built from what
the writers send: it must name each, including a fault that did not happen or met no traffic,
a stale read, entries left pending, and a trainer's sample in two committed steps or in none.
The injection checks are tested on a proxy that does not cut, delay or black-hole, and the
black hole on the proxy itself (no answer, no close, no reset). The short run (about 45 s of
writes under fourteen faults, the trainer's two kills included, plus start-up and drain)
must pass it with a nonzero traffic floor per fault, and fail without WAIT (acknowledged
writes lost in the WAIT-only fault); the deliberate failure (a consumer that commits without
acknowledging) must fail it, as trained twice.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
import uuid

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from benchmarks.faults.bench_faults import ROOT, FaultConfig, inject, report, run
from benchmarks.faults.fault_history import (
    History,
    check,
    check_file,
    digest,
    expected,
    final_entries,
    first_turn,
    flagged,
    floor,
    later_turn,
    load_history,
    trail,
)
from route_cache.config import Config
from route_cache.connection import connect
from route_cache.server import RouteCacheServer
from route_cache.store import RouteStore
from routereplay.dev.fault_proxy import FaultProxy
from routereplay.dev.redis_nodes import RedisProcess
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
    return check(history, SEED, 3, stored=lambda ids: {s: stored.get(s) for s in ids})


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


def test_a_failed_verdict_comes_with_each_wrong_samples_trail(tmp_path):
    """A CI log is all a failed run leaves: its report must tell what became of each sample
    found wrong (its events, the faults, the services' log lines naming it)."""
    fault = {
        "t": 1,
        "proc": "driver",
        "op": "fault",
        "name": "cache_kill",
        "component": "cache0",
        "began": 0.5,
        "end": 2.0,
        "detail": {},
    }
    deliver = {
        "t": 4,
        "proc": "c1",
        "op": "deliver",
        "samples": ["a", "e"],
        "entries": ["1-0", "2-0"],
    }
    history = [fault, *published("a"), *published("e"), deliver, *trained("a")]
    found = verdict(history, {s: expected(SEED, s, 3) for s in "ae"})
    assert flagged(found) == ["e"]
    (tmp_path / "cache0.log").write_text("claim of 'e' handed over\nclaim of 'a' lost\n")
    lines = trail(history, flagged(found), tmp_path)
    assert lines[0] == "trail of e:"
    assert "fault cache_kill on cache0" in lines[1]
    assert sum(" w append " in line or " w write " in line for line in lines) == 3
    assert any(" c1 deliver {'entries': ['2-0']}" in line for line in lines)
    assert lines[-1] == "  cache0.log: claim of 'e' handed over"
    assert not any("train" in line for line in lines)  # a's events are not e's


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


def fault(name, t, end, component, detail=None):
    return {
        "t": t,
        "proc": "driver",
        "op": "fault",
        "name": name,
        "component": component,
        "end": end,
        "detail": detail or {},
    }


def on(shard, t, ms, ok=True, sample="a", turn=0, via="any"):
    return {**op(t, sample, turn, ok=ok), "ms": ms, "shard": shard, "via": via}


def test_a_fault_that_did_not_happen_or_met_no_traffic_fails_the_run():
    whole = {"a": expected(SEED, "a", 3)}
    history = published("a") + trained("a")
    history += [on(0, 4.9, 300.0), on(0, 5.5, 10.0, turn=1), on(1, 6.0, 5.0, turn=2)]
    # shard 0: one op in flight at 5.0 (4.9 + 0.3 s), one started during it, both acknowledged
    history.append(fault("master_failover", 5.0, 7.0, "shard0"))
    assert verdict(history, whole).floors[-1] == {
        "fault": "master_failover",
        "component": "shard0",
        "started": 1,
        "in_flight": 1,
        "acknowledged": 2,
    }
    assert not verdict(history, whole).faults_without_traffic
    # shard 2 saw nothing: a zero floor fails the run
    quiet = history + [fault("proxy_drop", 5.0, 7.0, "shard2")]
    found = verdict(quiet, whole)
    assert not found.ok and found.faults_without_traffic == ["proxy_drop (shard2)"]
    # a fault whose injection raised fails the run even with traffic
    broken = history + [fault("master_aof_restart", 5.0, 7.0, "shard0", {"error": "no"})]
    found = verdict(broken, whole)
    assert not found.ok and found.faults_not_injected == ["master_aof_restart: no"]


def test_a_stopped_consumers_floor_is_the_batch_it_held():
    history = [
        {"t": 1.0, "proc": "c0", "op": "deliver", "samples": ["a", "b"]},
        {"t": 1.2, "proc": "c0", "op": "deliver", "samples": []},
        {"t": 5.0, "proc": "c1", "op": "deliver", "samples": ["a", "b"]},
        {"t": 5.1, "proc": "c1", "op": "ack", "samples": ["a", "b"], "ok": True},
    ]
    held = floor(history, fault("consumer_stop", 2.0, 7.0, "c0"))
    assert (held["started"], held["in_flight"], held["acknowledged"]) == (1, 2, 2)
    settled_first = [*history[:1], {**history[3], "t": 1.5, "proc": "c0"}]
    held = floor(settled_first, fault("consumer_stop", 2.0, 7.0, "c0"))
    assert held["in_flight"] == 0  # it had settled its batch before the stop


def trainer_life(steps_done, steps, finish=None, t=10.0):
    """One trainer process's history: resumed after ``steps_done`` steps, then ``steps`` as
    (step, samples), then (``finish``) its final checkpoint."""
    out = [{"t": t, "proc": "trainer", "op": "resume", "steps_done": steps_done}]
    for step, samples in steps:
        digests = [digest(expected(SEED, s, 3)) for s in samples]
        out.append(
            {"t": t, "proc": "trainer", "op": "step", "step": step, "samples": samples,
             "digests": digests}
        )  # fmt: skip
    if finish is not None:
        out.append({"t": t, "proc": "trainer", "op": "finish", "steps_done": finish})
    return out


def test_the_trainers_committed_steps_are_checked():
    """Steps of a killed trainer past the checkpoint it resumed from are discarded, not
    committed: a sample in two committed steps is trained twice, a published sample in no
    committed step never trained (even if a discarded step trained it)."""
    whole = {s: expected(SEED, s, 3) for s in "abcd"}
    history = []
    for s in "abcd":
        history += published(s) + trained(s)
    # killed after step 2 (checkpoint after 2 steps): step 2 ("c") is discarded, trained again
    clean = trainer_life(0, [(0, ["a"]), (1, ["b"]), (2, ["c"])])
    clean += trainer_life(2, [(2, ["c"]), (3, ["d"])], finish=4, t=20.0)
    found = verdict(history + clean, whole)
    assert found.ok, found.lines()
    assert found.counts["trainer steps trained / committed / discarded"] == "5 / 4 / 1"
    # acknowledged "c" with step 2, resumed after 2 steps: "c" is never offered again
    lost = trainer_life(0, [(0, ["a"]), (1, ["b"]), (2, ["c"])])
    lost += trainer_life(2, [(2, ["d"])], finish=3, t=20.0)
    found = verdict(history + lost, whole)
    assert found.trainer_never_trained == ["c"] and not found.trainer_trained_twice
    # killed after step 1's checkpoint, before its acknowledgement: "b" offered again
    twice = trainer_life(0, [(0, ["a"]), (1, ["b"])])
    twice += trainer_life(2, [(2, ["b"]), (3, ["c"]), (4, ["d"])], finish=5, t=20.0)
    found = verdict(history + twice, whole)
    assert found.trainer_trained_twice == ["b"] and not found.trainer_never_trained
    assert verdict(history + twice[:-1], whole).trainer_unfinished


def test_a_record_freed_before_every_group_committed_it_fails_the_run():
    """The final read says which records the route cache freed (their expiry within its
    grace): only samples that the consumers' group and the trainer both acknowledged may be."""
    history = []
    for s in "abc":
        history += published(s) + trained(s)
    history += trainer_life(0, [(0, ["a"]), (1, ["b"]), (2, ["c"])], finish=3)
    history.append({"t": 11, "proc": "trainer", "op": "ack", "samples": ["a", "b"], "ok": True})
    final = final_entries(
        {s: expected(SEED, s, 3) for s in "abc"}, {"a": True, "b": False, "c": True}
    )
    found = check(history + final, SEED, 3)
    assert found.freed_before_commit == ["c"]  # the trainer never acknowledged it
    final = final_entries({s: expected(SEED, s, 3) for s in "abc"}, {"a": True})
    assert check(history + final, SEED, 3).ok


def test_reads_and_the_feed_left_pending_are_checked():
    whole = {"a": expected(SEED, "a", 3)}
    history = published("a") + trained("a")
    stale = {"t": 3.5, "proc": "driver", "op": "read", "ok": True, "ms": 1.0, "shard": 0}
    stale["got"] = [["a", 1, digest(expected(SEED, "a", 1)), 2]]  # 1 turn after 2 were acked
    assert verdict(history + [stale], whole).read_wrong == ["a"]
    fine = {**stale, "got": [["a", 2, digest(expected(SEED, "a", 2)), 2]]}
    assert verdict(history + [fine], whole).ok
    feed = {"t": 9, "proc": "final", "op": "feed_state", "groups": [{"name": "g", "pending": 2}]}
    assert verdict(history + [feed], whole).feed_left_pending == ["g: 2 pending"]


def test_the_checker_command_reads_the_verdict_from_the_file_alone(tmp_path):
    history = [{"t": 0, "proc": "driver", "op": "config", "seed": SEED, "turns": 3}]
    history += published("a") + published("b") + trained("a")
    history += final_entries({"a": expected(SEED, "a", 3), "b": expected(SEED, "b", 1)})
    path = tmp_path / "h.jsonl"
    path.write_text("".join(json.dumps(e) + "\n" for e in history))
    found, _ = check_file(path)
    assert found.lost == ["b"] and found.never_trained == ["b"]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.faults.fault_check", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert done.returncode == 1 and "verdict: FAIL" in done.stdout, done.stdout + done.stderr
    assert "lost: 1" in done.stdout


class OneShard:
    """What ``inject`` needs of the run's environment for the proxy faults: one node behind
    its proxy, as shard 0's and shard 2's master (a black hole's heal waits for no write)."""

    config = FaultConfig(redis_socket_timeout_s=0.5)

    class traffic:  # noqa: N801 - stands in for the run's Traffic
        @staticmethod
        def wait_acked(shard, timeout_s):
            return True

    def __init__(self, node, proxy):
        self.node, self.proxies = node, {node.port: proxy}

    def master_of(self, shard):
        return self.node


@pytest.mark.parametrize("broken", [False, True])
def test_a_proxy_that_does_not_cut_or_delay_fails_its_injection(broken, monkeypatch):
    """The injection checks: a proxy that resets nothing and answers new connections, or
    that does not delay, raises (the run then logs an ``error`` and fails)."""
    node = RedisProcess().start()
    proxy = FaultProxy(node.port).start()
    held = redis.Redis(port=proxy.port)
    try:
        held.ping()  # an open connection through the proxy, for drop to reset
        if broken:
            monkeypatch.setattr(proxy, "drop", lambda seconds: None)
            never_delays = property(lambda p: 0.0, lambda p, v: None)
            monkeypatch.setattr(FaultProxy, "delay_s", never_delays, raising=False)
            with pytest.raises(RuntimeError, match="did not cut"):
                inject(OneShard(node, proxy), "proxy_drop", 0.5, lambda: None)
            with pytest.raises(RuntimeError, match="delaying proxy"):
                inject(OneShard(node, proxy), "proxy_delay", 0.3, lambda: None)
        else:
            assert inject(OneShard(node, proxy), "proxy_drop", 0.5, lambda: None)["reset"] >= 1
            assert (
                inject(OneShard(node, proxy), "proxy_delay", 0.3, lambda: None)["probe_ping_s"]
                >= 0.15
            )
    finally:
        held.close()
        proxy.close()
        node.stop()


def test_the_proxy_black_holes_without_closing_or_forwarding():
    """``blackhole``: a connection open before it and one opened during it get no answer and
    neither a reset nor a close (a client meets its socket time-out, not a fast failure);
    afterwards both get their answers, nothing lost (TCP would have resent it); the injection
    check passes on it (and fails on a proxy that resets or forwards: the next test)."""
    node = RedisProcess().start()
    proxy = FaultProxy(node.port).start()
    try:
        before = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        before.sendall(b"PING\r\n")
        assert before.recv(64) == b"+PONG\r\n"
        proxy.blackhole(1.5)
        during = socket.create_connection(("127.0.0.1", proxy.port), timeout=5)
        for sock in (before, during):
            sock.settimeout(0.4)
            sock.sendall(b"PING\r\n")  # would raise on a reset connection
            with pytest.raises(TimeoutError):  # not b"" (closed), not a reset
                sock.recv(64)
        assert proxy.black_holed == 1
        time.sleep(1.0)
        for sock in (before, during):  # the black hole is over: the answers come
            sock.settimeout(2)
            assert sock.recv(64) == b"+PONG\r\n"
            sock.close()
        # An open connection for the injection to silence, and a PING on it during the black
        # hole that meets its socket time-out (the client then closes it: given up).
        held = redis.Redis(port=proxy.port, socket_timeout=0.5, retry=Retry(NoBackoff(), 0))
        assert held.ping()
        timed_out = []

        def ping_late():
            time.sleep(0.2)
            with pytest.raises(redis.TimeoutError):
                held.ping()
            timed_out.append(True)

        pinger = threading.Thread(target=ping_late)
        pinger.start()
        detail = inject(OneShard(node, proxy), "proxy_blackhole", 1.0, lambda: None)
        pinger.join()
        assert timed_out and detail["silenced"] == 1 and detail["given_up"] == 1
        assert detail["probe"].startswith("timed out")
        held.close()
    finally:
        proxy.close()
        node.stop()


@pytest.mark.parametrize("broken", ["resets", "forwards"])
def test_a_proxy_that_does_not_black_hole_fails_its_injection(broken, monkeypatch):
    node = RedisProcess().start()
    proxy = FaultProxy(node.port).start()
    held = redis.Redis(port=proxy.port)
    try:
        held.ping()  # an open connection through the proxy, for the black hole to silence
        if broken == "resets":
            monkeypatch.setattr(proxy, "blackhole", proxy.drop)
        else:
            monkeypatch.setattr(proxy, "blackhole", lambda seconds: None)
        with pytest.raises(RuntimeError, match="did not black-hole"):
            inject(OneShard(node, proxy), "proxy_blackhole", 1.0, lambda: None)
    finally:
        held.close()
        proxy.close()
        node.stop()


@pytest.mark.slow
def test_short_fault_run_passes_the_checker_with_a_traffic_floor_per_fault(tmp_path):
    results = run(FaultConfig(duration_s=24.0, short=True), tmp_path)
    print(report(results))
    assert results["verdict"], "\n".join(results["verdict_lines"])
    names = [f["fault"] for f in results["floors"]]
    assert {"wait_only", "proxy_blackhole"} <= set(names) and len(names) == 14
    new = {"consumer_kill_between", "feed_blackhole", "double_failover", "replica_link_mute"}
    assert new <= set(names)
    assert {"trainer_kill_ack", "trainer_kill_step"} <= set(names)
    assert all(f["started"] and f["in_flight"] and f["acknowledged"] for f in results["floors"])
    # the trainer was killed twice and restarted; the kill after an acknowledgement, before
    # the next checkpoint, discarded at least one step it had trained
    assert results["counts"]["trainer processes"] >= 3
    assert results["counts"]["trainer samples in discarded steps"] >= 1
    assert results["counts"]["samples published (final turn acknowledged)"] > 60
    # the lifecycle under fire: records were freed as both groups committed them
    assert results["counts"]["records freed (every group committed them)"] > 60
    # the checker command, from the history file alone, gives the same verdict
    found, _ = check_file(tmp_path / "faults-history.jsonl")
    assert found.ok and found.lines() == results["verdict_lines"]


@pytest.mark.slow
def test_short_fault_run_without_wait_loses_acknowledged_writes(tmp_path):
    """The WAIT-only fault (shard 1's replica cut off, then its master killed): without WAIT
    the writes that shard acknowledged during the cut are lost, and the run fails."""
    results = run(FaultConfig(duration_s=24.0, short=True, wait_replicas=0), tmp_path)
    print(report(results))
    assert not results["verdict"]
    assert results["checker"]["lost"], "\n".join(results["verdict_lines"])
    assert not results["checker"]["faults_not_injected"]


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
                    "-m",
                    "benchmarks.faults.fault_consumer",
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
                consumers.append(subprocess.Popen(args, cwd=ROOT))
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
    found = check(entries, SEED, 3, stored=lambda ids: {s: stored.get(s) for s in ids})
    if not drop_ack:
        assert found.ok, found.lines()
        return
    dropped = next(e["samples"] for e in entries if e["op"] == "dropped_ack")
    assert found.trained_twice == sorted(dropped), "\n".join(found.lines())
    assert not (found.lost or found.never_trained or found.half_written)
