"""The fault run: load and faults at once, Jepsen-style, checked afterwards.

On loopback, bounded in time and operations:

- a Redis Cluster of 3 masters with a replica each (real ``redis-server`` processes, append-only
  files fsynced every second, ``cluster-node-timeout`` 1 s), each node behind a fault proxy
  (``routereplay.dev.fault_proxy``) that stands in for the network. Nodes announce their
  proxy's port (``cluster-announce-port``), so every client connection, redirects included,
  and the replication links go through the proxies; the cluster bus (gossip, failure
  detection) does not (``cluster-announce-bus-port`` is the real one);
- two route cache processes (``python -m route_cache``, ``--wait-replicas 1`` by default) that
  clients reach through one target naming both (``ipv4:A,B``, what a headless Service gives),
  with client-side round-robin balancing and failover;
- writers at a fixed rate, each sample a write and two appends (the last one ``final``, which
  announces it on the ready feed), through the blocking client and its default retries;
- two ready-feed consumer processes (``fault_consumer.py``) that train a stand-in step,
  commit, then acknowledge.

Faults on a schedule, each logged with its start and end: a route cache replica SIGKILLed
then restarted; a Redis master SIGKILLed so that its replica is promoted (then restarted as a
replica); a Redis master SIGKILLed and restarted from its append-only file; a consumer
SIGSTOPped past the feed's claim time-out, then resumed; the proxies delaying all traffic;
one master's proxy dropping its connections.

Then the checker (``fault_history.check``) reads the history and the stored records and
prints its verdict with the figures: write availability, p50/p99 latency outside and during
each fault, recovery time per fault, and a PNG timeline.

Usage: python benchmarks/bench_faults.py [--short] [--wait-replicas N] [--drop-ack]
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)] if str(ROOT) not in sys.path else []

from benchmarks.fault_history import (  # noqa: E402
    History,
    check,
    first_turn,
    later_turn,
    load_history,
)
from routereplay.dev.fault_proxy import FaultProxy  # noqa: E402
from routereplay.dev.launch import free_ports, stop_process, wait_serving  # noqa: E402
from routereplay.dev.redis_nodes import RedisProcess, start_cluster_with_replicas  # noqa: E402
from routereplay.domain.record import Record  # noqa: E402
from routereplay.errors import RouteReplayError  # noqa: E402
from routereplay.rpc.client import RetryPolicy, RouteCacheClient  # noqa: E402

# The writers' retry budget: the client's defaults (9.4-18.7 s of backoff, pauses of at most
# 0.5 s), what a caller that names none gets.
RETRY = RetryPolicy()
OP_TIMEOUT_S = 5.0
IN_FLIGHT_S = 0.5


@dataclass
class FaultConfig:
    """duration_s: how long writers write; writers x rate: operations per second (each a
    write or an append); turns: per sample; wait_replicas: the route cache's flag;
    claim_idle_ms: when a consumer takes over another's unacknowledged entries; short: the
    compressed schedule of the test suite; drop_ack: consumer c1 skips one acknowledgement
    (the checker must then fail); max_ops: a bound besides the time."""

    duration_s: float = 90.0
    writers: int = 3
    rate: float = 4.0
    turns: int = 3
    wait_replicas: int = 1
    claim_idle_ms: int = 3000
    node_timeout_ms: int = 1000
    short: bool = False
    drop_ack: bool = False
    max_ops: int = 5000
    seed: int = 0
    sync_delay_s: int = 0  # repl-diskless-sync-delay (Redis's default, 5, stalls WAIT)


# (start s, fault, its parameter): the full schedule and the test suite's compressed one.
SCHEDULES = {
    False: [
        (8, "cache_kill", 3.0),
        (20, "master_failover", 0),
        (36, "master_aof_restart", 1),
        (48, "consumer_stop", 2.0),
        (62, "proxy_delay", 6.0),
        (74, "proxy_drop", 2.0),
    ],
    True: [
        (3, "cache_kill", 1.5),
        (7, "master_failover", 0),
        (13, "master_aof_restart", 1),
        (16, "consumer_stop", 1.5),
        (21, "proxy_delay", 2.0),
        (24, "proxy_drop", 1.5),
    ],
}


class Environment:
    """The cluster behind its proxies, the two route caches and the two consumers."""

    def __init__(self, config: FaultConfig, workdir: Path, start: float):
        self.config, self.workdir, self.start = config, workdir, start
        self.proxies: dict[int, FaultProxy] = {}  # node port -> its proxy
        self.masters: list[RedisProcess] = []
        self.replicas: list[RedisProcess] = []
        self.cache_ports = free_ports(2)
        self.caches: list[subprocess.Popen | None] = [None, None]
        self.consumers: list[subprocess.Popen] = []
        self.stop_file = workdir / "stop"

    @property
    def target(self) -> str:
        return "ipv4:" + ",".join(f"127.0.0.1:{p}" for p in self.cache_ports)

    def _node(self) -> RedisProcess:
        """A cluster node with an append-only file, announcing its proxy's port."""
        node = RedisProcess(
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--repl-diskless-sync-delay",
            str(self.config.sync_delay_s),
            cluster=True,
            workdir=tempfile.mkdtemp(dir=self.workdir),
        )
        proxy = FaultProxy(node.port).start()
        node.extra += [
            "--cluster-announce-ip",
            "127.0.0.1",
            "--cluster-announce-port",
            str(proxy.port),
            "--cluster-announce-bus-port",
            str(node.bus_port),
        ]
        self.proxies[node.port] = proxy
        return node

    def start_redis(self) -> None:
        self.masters, self.replicas = start_cluster_with_replicas(
            3, 1, self.config.node_timeout_ms, make_node=self._node
        )
        for node in self.masters + self.replicas:
            if self.proxies.get(node.port) is None:  # a start retried on other ports
                raise RuntimeError("a cluster node moved port while starting; run again")

    def start_cache(self, i: int) -> None:
        seed = self.proxies[self.masters[1].port].port
        args = [
            sys.executable,
            "-m",
            "route_cache",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.cache_ports[i]),
            "--redis-url",
            f"redis://127.0.0.1:{seed}",
            "--redis-cluster",
            "--wait-replicas",
            str(self.config.wait_replicas),
            "--grace-s",
            "1",
            "--health-interval-s",
            "0.2",
        ]
        with open(self.workdir / f"cache{i}.log", "ab") as log:
            proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, process_group=0)
        wait_serving(f"127.0.0.1:{self.cache_ports[i]}", proc, 30)
        self.caches[i] = proc

    def start_consumers(self) -> None:
        for i in range(2):
            args = [
                sys.executable,
                str(ROOT / "benchmarks" / "fault_consumer.py"),
                "--target",
                self.target,
                "--name",
                f"c{i}",
                "--history",
                str(self.workdir / f"c{i}.jsonl"),
                "--stop-file",
                str(self.stop_file),
                "--start",
                repr(self.start),
                "--claim-idle-ms",
                str(self.config.claim_idle_ms),
            ]
            if self.config.drop_ack and i == 1:
                args += ["--drop-ack-step", "3"]
            with open(self.workdir / f"c{i}.log", "ab") as log:
                self.consumers.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT))

    def master_of(self, shard: int) -> RedisProcess:
        """The node that is master of ``shard`` now (a failover swaps the pair)."""
        pair = (self.masters[shard], self.replicas[shard])
        for node in pair:
            try:
                if redis.Redis(port=node.port).info("replication")["role"] == "master":
                    return node
            except redis.ConnectionError:
                continue
        raise RuntimeError(f"shard {shard} has no master")

    def restart_node(self, node: RedisProcess) -> None:
        node.start()  # same port and directory: it reloads its append-only file
        redis.Redis(port=node.port).config_set("cluster-node-timeout", self.config.node_timeout_ms)

    def stop(self) -> None:
        self.stop_file.touch()
        for proc in self.consumers:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        for proc in self.caches:
            if proc is not None:
                stop_process(proc, 5)
        for node in self.masters + self.replicas:
            node.kill()
        for proxy in self.proxies.values():
            proxy.close()


# --- faults -----------------------------------------------------------------------------------


def wait_until(condition, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not happen within {timeout_s:.0f} s")
        time.sleep(0.05)


def _role(node: RedisProcess) -> dict:
    try:
        return redis.Redis(port=node.port, socket_timeout=1).info("replication")
    except redis.RedisError:
        return {}


def inject(env: Environment, name: str, value: float) -> dict:
    """Run fault ``name`` (inject, wait, heal); returns details to log with it."""
    if name == "cache_kill":
        env.caches[0].kill()  # SIGKILL
        env.caches[0].wait()
        time.sleep(value)
        env.start_cache(0)
        return {"down_s": value}
    if name == "master_failover":
        victim = env.master_of(int(value))
        heir = env.replicas[0] if victim is env.masters[0] else env.masters[0]
        started = time.monotonic()
        victim.kill()
        wait_until(lambda: _role(heir).get("role") == "master", 30, "the replica's promotion")
        failover_s = time.monotonic() - started
        env.restart_node(victim)  # rejoins as the new master's replica, from its AOF
        wait_until(lambda: _role(victim).get("master_link_status") == "up", 30, "resync")
        return {
            "node": victim.port,
            "failover_s": round(failover_s, 2),
            "replica_linked_s": round(time.monotonic() - started, 2),
        }
    if name == "master_aof_restart":
        victim = env.master_of(int(value))
        replica = env.replicas[1] if victim is env.masters[1] else env.masters[1]
        started = time.monotonic()
        victim.kill()
        time.sleep(0.3)
        env.restart_node(victim)
        role = _role(victim).get("role")
        wait_until(lambda: _role(replica).get("master_link_status") == "up", 30, "resync")
        return {
            "node": victim.port,
            "role_after": role,
            "replica_linked_s": round(time.monotonic() - started, 2),
        }
    if name == "consumer_stop":
        stopped_s = env.config.claim_idle_ms / 1000 + value
        env.consumers[0].send_signal(signal.SIGSTOP)
        time.sleep(stopped_s)
        env.consumers[0].send_signal(signal.SIGCONT)
        return {"consumer": "c0", "stopped_s": stopped_s}
    if name == "proxy_delay":
        for proxy in env.proxies.values():
            proxy.delay_s = 0.1
        time.sleep(value)
        for proxy in env.proxies.values():
            proxy.delay_s = 0.0
        return {"delay_ms": 100, "s": value}
    if name == "proxy_drop":
        victim = env.master_of(2)
        proxy = env.proxies[victim.port]
        proxy.drop(value)
        time.sleep(value)
        return {"node": victim.port, "refused_s": value, "reset": proxy.dropped}
    raise ValueError(name)


def nemesis(env: Environment, history: History, schedule, stop: threading.Event) -> None:
    for at, name, value in schedule:
        while history.now() < at:
            if stop.wait(0.05):
                return
        start = history.now()
        try:
            detail = inject(env, name, value)
        except Exception as exc:  # noqa: BLE001 - logged; the checker still runs
            detail = {"error": repr(exc)}
        history.log(
            "fault", t=round(start, 3), name=name, end=round(history.now(), 3), detail=detail
        )


# --- load -------------------------------------------------------------------------------------


def writer(
    w: int,
    env: Environment,
    history: History,
    config: FaultConfig,
    prefix: str,
    ops: list[int],
    deadline: float,
) -> None:
    """Samples one after the other, one operation every 1 / rate seconds (no catching up)."""
    period = 1.0 / config.rate
    next_at = time.monotonic()
    with RouteCacheClient(env.target, timeout_s=OP_TIMEOUT_S, retry=RETRY) as client:
        for i in range(config.max_ops):
            sample_id = f"{prefix}-w{w}-{i}"
            for turn in range(config.turns):
                time.sleep(max(0.0, next_at - time.monotonic()))
                next_at = max(next_at + period, time.monotonic())
                if history.now() >= deadline or ops[0] >= config.max_ops:
                    return
                ops[0] += 1
                final = turn == config.turns - 1
                start = history.now()
                try:
                    if turn == 0:
                        client.write(first_turn(config.seed, sample_id), more_turns=True)
                    else:
                        client.append(later_turn(config.seed, sample_id, turn), final=final)
                    ok, status = True, None
                except RouteReplayError as exc:
                    ok, status = False, exc.status
                history.log(
                    "append" if turn else "write",
                    t=round(start, 4),
                    sample=sample_id,
                    turn=turn,
                    final=final,
                    ok=ok,
                    status=status,
                    ms=round((history.now() - start) * 1000, 2),
                )
                if not ok:
                    break  # the sample is abandoned: its later turns are never attempted


def read_stored(target: str):
    """``stored(ids)`` for the checker: the records the route cache holds now."""

    def stored(sample_ids: list[str]) -> dict[str, Record | None]:
        out: dict[str, Record | None] = {}
        with RouteCacheClient(target, timeout_s=30, retry=RETRY) as client:
            for i in range(0, len(sample_ids), 256):
                for item in client.read_batch(sample_ids[i : i + 256], skip_missing=True):
                    out[item.sample_id] = item if isinstance(item, Record) else None
        return out

    return stored


# --- figures ----------------------------------------------------------------------------------


def _pcts(ms: list[float]) -> dict:
    if not ms:
        return {"count": 0, "p50_ms": None, "p99_ms": None}
    a = np.asarray(ms)
    return {
        "count": len(ms),
        "p50_ms": round(float(np.percentile(a, 50)), 1),
        "p99_ms": round(float(np.percentile(a, 99)), 1),
    }


def figures(history: list[dict], config: FaultConfig, after_s: float = 3.0) -> dict:
    """Availability, latency outside and during each fault (its span plus ``after_s``),
    recovery per fault, and the feed's publish-to-train delay."""
    ops = [e for e in history if e["op"] in ("write", "append")]
    faults = [e for e in history if e["op"] == "fault"]
    spans = [(f["t"], f["end"] + after_s) for f in faults]
    outside = [e["ms"] for e in ops if e["ok"] and not any(a <= e["t"] < b for a, b in spans)]
    base_p99 = float(np.percentile(outside, 99)) if outside else 100.0
    slow_ms = max(3 * base_p99, 250.0)
    # An operation that failed or was slow counts against the last fault that began before it
    # did (or within ``IN_FLIGHT_S`` after: it was in flight when the fault hit); a fault's
    # recovery ends when the last such operation does.
    recovered = [0.0] * len(faults)
    for e in ops:
        hit = [i for i, f in enumerate(faults) if f["t"] <= e["t"] + IN_FLIGHT_S]
        if (not e["ok"] or e["ms"] > slow_ms) and hit:
            end = e["t"] + e["ms"] / 1000
            recovered[hit[-1]] = max(recovered[hit[-1]], end - faults[hit[-1]]["t"])
    per_fault = []
    for f, recovery in zip(faults, recovered, strict=True):
        during = [e for e in ops if f["t"] <= e["t"] < f["end"] + after_s]
        per_fault.append(
            {
                "fault": f["name"],
                "start_s": f["t"],
                "healed_s": round(f["end"] - f["t"], 2),
                "detail": f["detail"],
                "ops": len(during),
                "failed": sum(not e["ok"] for e in during),
                **_pcts([e["ms"] for e in during if e["ok"]]),
                "recovery_s": round(recovery, 2),
                "after_heal_s": round(max(0.0, recovery - (f["end"] - f["t"])), 2),
            }
        )
    published = {e["sample"]: e["t"] + e["ms"] / 1000 for e in ops if e["ok"] and e["final"]}
    delays = [
        e["t"] - published[e["sample"]]
        for e in history
        if e["op"] == "train" and e["sample"] in published
    ]
    ok = sum(e["ok"] for e in ops)
    return {
        "operations": len(ops),
        "succeeded": ok,
        "availability": round(ok / len(ops), 5) if ops else None,
        "failed_by_status": dict(
            sorted(
                {
                    s: sum(e.get("status") == s for e in ops if not e["ok"])
                    for s in {e.get("status") for e in ops if not e["ok"]}
                }.items()
            )
        ),
        "latency_outside_faults": _pcts(outside),
        "slow_threshold_ms": round(slow_ms, 1),
        "faults": per_fault,
        "publish_to_train_s": {
            "p50": round(float(np.percentile(delays, 50)), 2) if delays else None,
            "max": round(max(delays), 2) if delays else None,
        },
        "recovery_target_s": config.node_timeout_ms / 1000 + 2,
    }


def timeline(history: list[dict], path: Path, title: str) -> None:
    """Throughput and latency per second, faults shaded, as a small PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = [e for e in history if e["op"] in ("write", "append")]
    end = int(max(e["t"] for e in ops)) + 1
    ok = np.zeros(end)
    bad = np.zeros(end)
    lat: list[list[float]] = [[] for _ in range(end)]
    for e in ops:
        b = int(e["t"])
        if e["ok"]:
            ok[b] += 1
            lat[b].append(e["ms"])
        else:
            bad[b] += 1
    trained = np.zeros(end)
    for e in history:
        if e["op"] == "train" and int(e["t"]) < end:
            trained[int(e["t"])] += 1
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 4.6), sharex=True, dpi=80)
    x = np.arange(end)
    top.step(x, ok, where="post", label="operations ok / s", color="tab:blue")
    top.step(x, trained, where="post", label="samples trained / s", color="tab:green", lw=0.8)
    top.bar(x, bad, width=1, align="edge", color="tab:red", label="failed / s")
    top.set_ylabel("per second")
    top.legend(loc="upper right", fontsize=7, ncol=3)
    p50 = [np.percentile(v, 50) if v else np.nan for v in lat]
    p99 = [np.percentile(v, 99) if v else np.nan for v in lat]
    bottom.step(x, p50, where="post", label="p50", color="tab:blue")
    bottom.step(x, p99, where="post", label="p99", color="tab:orange")
    bottom.set_yscale("log")
    bottom.set_ylabel("write latency, ms")
    bottom.set_xlabel("seconds")
    bottom.legend(loc="upper right", fontsize=7)
    for f in (e for e in history if e["op"] == "fault"):
        for ax in (top, bottom):
            ax.axvspan(f["t"], max(f["end"], f["t"] + 0.3), color="grey", alpha=0.25)
        top.text(
            f["t"],
            top.get_ylim()[1] * 0.97,
            f["name"],
            fontsize=6,
            rotation=90,
            va="top",
            ha="right",
        )
    top.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


# --- the run ----------------------------------------------------------------------------------


def run(config: FaultConfig, out: Path, png: Path | None = None) -> dict:
    """One fault run; the merged history goes to ``out/faults-history.jsonl``. Returns the
    verdict, its lines and the figures."""
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="rr-faultrun-"))
    start = time.time()
    history = History(workdir / "driver.jsonl", "driver", start)
    env = Environment(config, workdir, start)
    stop = threading.Event()
    prefix = f"fr-{uuid.uuid4().hex[:6]}"
    try:
        env.start_redis()
        env.start_cache(0)
        env.start_cache(1)
        env.start_consumers()
        t0 = history.now()
        schedule = [(t0 + at, name, value) for at, name, value in SCHEDULES[config.short]]
        chaos = threading.Thread(target=nemesis, args=(env, history, schedule, stop))
        chaos.start()
        ops = [0]
        writers = [
            threading.Thread(
                target=writer, args=(w, env, history, config, prefix, ops, t0 + config.duration_s)
            )
            for w in range(config.writers)
        ]
        for thread in writers:
            thread.start()
        for thread in writers:
            thread.join()
        chaos.join()
        published = {
            e["sample"] for e in history.entries if e["op"] == "append" and e["ok"] and e["final"]
        }
        consumer_logs = [workdir / "c0.jsonl", workdir / "c1.jsonl"]
        drain_deadline = time.monotonic() + 30
        while time.monotonic() < drain_deadline:  # every published sample trained, or give up
            trained = {e["sample"] for e in load_history(consumer_logs) if e["op"] == "train"}
            if published <= trained:
                break
            time.sleep(0.5)
        time.sleep(config.claim_idle_ms / 1000 + 1)  # room for a late double train to show
        env.stop_file.touch()
        for proc in env.consumers:
            proc.wait(30)
        entries = load_history([workdir / "driver.jsonl", *consumer_logs])
        verdict = check(entries, config.seed, read_stored(env.target), config.turns)
    finally:
        stop.set()
        history.close()
        env.stop()
    (out / "faults-history.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
    results = {
        "config": asdict(config),
        "verdict": verdict.ok,
        "verdict_lines": verdict.lines(),
        "checker": {k: v for k, v in asdict(verdict).items() if k != "counts"},
        "counts": verdict.counts,
        **figures(entries, config),
    }
    if png is not None:
        wait = f"--wait-replicas {config.wait_replicas}"
        timeline(entries, png, f"fault run, {wait}: writes and training under faults (shaded)")
    for log in workdir.glob("*.log"):  # the services' own logs, for a look afterwards
        shutil.copy(log, out / log.name)
    shutil.rmtree(workdir, ignore_errors=True)
    return results


def report(results: dict) -> str:
    """The verdict and the figures, as printed and as the docs section."""
    f = results
    out = list(f["verdict_lines"])
    out.append(
        f"write availability: {f['succeeded']} of {f['operations']} operations "
        f"({100 * (f['availability'] or 0):.2f}%); failed by status: "
        f"{f['failed_by_status'] or 'none'}"
    )
    o = f["latency_outside_faults"]
    out.append(
        f"latency outside faults: p50 {o['p50_ms']} ms, p99 {o['p99_ms']} ms ({o['count']} ops)"
    )
    out.append(
        f"{'fault':20} {'start s':>7} {'healed s':>8} {'ops':>4} {'failed':>6} "
        f"{'p50 ms':>7} {'p99 ms':>8} {'recovery s':>10} {'after heal s':>12}"
    )
    for x in f["faults"]:
        out.append(
            f"{x['fault']:20} {x['start_s']:7.1f} {x['healed_s']:8.1f} {x['ops']:4} "
            f"{x['failed']:6} {x['p50_ms'] or '-':>7} {x['p99_ms'] or '-':>8} "
            f"{x['recovery_s']:10.2f} {x['after_heal_s']:12.2f}  {x['detail']}"
        )
    out.append(
        f"recovery target: {f['recovery_target_s']} s; publish -> trained: "
        f"p50 {f['publish_to_train_s']['p50']} s, max {f['publish_to_train_s']['max']} s"
    )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="the test suite's ~30 s schedule")
    parser.add_argument("--duration", type=float, default=None, help="seconds of writes")
    parser.add_argument("--wait-replicas", type=int, default=1)
    parser.add_argument(
        "--drop-ack",
        action="store_true",
        help="consumer c1 skips one acknowledgement: the checker must fail",
    )
    parser.add_argument("--quick", action="store_true", help="run_all's smoke run: --short")
    args = parser.parse_args(argv)
    short = args.short or args.quick
    config = FaultConfig(
        duration_s=args.duration or (28.0 if short else 90.0),
        short=short,
        wait_replicas=args.wait_replicas,
        drop_ack=args.drop_ack,
    )
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import RESULTS, machine, write_section

    name = (
        "faults"
        + ("_no_wait" if not args.wait_replicas else "")
        + ("_drop_ack" if args.drop_ack else "")
    )
    png = None
    if not short and name == "faults":
        png = ROOT / "docs" / "reliability-faults.png"
    results = run(config, RESULTS / name, png or RESULTS / f"{name}.png")
    text = report(results)
    print(text)
    results["machine"] = machine()
    command = (
        "python benchmarks/bench_faults.py"
        + " --short" * short
        + (f" --wait-replicas {args.wait_replicas}" if args.wait_replicas != 1 else "")
        + (" --drop-ack" * args.drop_ack)
    )
    write_section(
        name,
        f"## Fault run: {name}\n\n`{command}`. Machine: {results['machine']}."
        f"\n\n```\n{text}\n```\n",
        results,
    )
    return 0 if results["verdict"] else 1


if __name__ == "__main__":
    sys.exit(main())
