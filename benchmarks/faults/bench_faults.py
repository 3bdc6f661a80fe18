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
  with client-side round-robin balancing and failover; their Redis socket time-out is 4 s
  (``?socket_timeout=4`` in ``--redis-url``; the service's own is 30 s), so that a black hole
  that outlasts it fits the run;
- open-loop writers: one per shard, drawing its sample ids from that shard's slots, and one
  that sends to route cache 0 only; each starts a sample every ``1 / sample_rate`` seconds
  whatever became of the earlier ones (a write and two appends, the last ``final``, which
  announces it on the ready feed), through the blocking client and its default retries;
- one reader per shard, reading back samples of that shard already acknowledged;
- two ready-feed consumer processes (``fault_consumer.py``) that train a stand-in step,
  settle, then commit;
- the trainer's own feed path (``fault_trainer.py``: ``FeedPlans``, ``CacheSource``, a
  checkpoint every 3 steps, ``FeedPlans.ack``; a stand-in step) on a consumer group of its
  own, or with ``--trainer megatron`` the real one (``fault_megatron.py``: ``python -m
  trainer``, megatron-core on 2 gloo ranks under torchrun, R3 on a tiny model of the records'
  geometry), killed (SIGKILL between a step's checkpoint and its acknowledgement, between an
  acknowledgement and the next checkpoint, and, in the full schedule, mid-step) and
  restarted, as a supervisor would; the checker counts its steps trained, committed (the
  final weights descend from them) and discarded.

Faults on a schedule (``SCHEDULES``), each on a component (a shard, route cache 0, consumer
c0, or everything) and injected only while an operation on that component is in flight; each
is checked to have happened (a promotion, the role after a restart, a proxy that really
delays, refuses or cuts, a black hole a PING through which times out, a stopped process),
else the run fails. The history records per
fault the operations started, in flight at the injection and acknowledged on its component
(its traffic floor); a zero fails the run.

Then the final read (turns held and digest per sample) and the ready feed's final state go
into the history, and the checker (``fault_history.check``) gives its verdict from the
history alone, as ``fault_check.py`` does from the file; the figures: write availability,
the longest write gap per shard, p50/p99 latency outside and during each fault, recovery
time per fault, and a PNG timeline.

Usage: python -m benchmarks.faults.bench_faults [--short | --soak] [--wait-replicas N] [--drop-ack]
                    [--trainer stand-in|megatron]
                    [--mutate early-ack|commit-before-settle|no-aof|trainer-early-ack|
                              claim-apart|no-dead-letter]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.retry import Retry

from benchmarks.common import wait_until
from benchmarks.faults import fault_megatron
from benchmarks.faults.fault_history import (
    TRAINER,
    WRITES,
    History,
    check,
    digest,
    final_entries,
    first_turn,
    flagged,
    is_consumer,
    later_turn,
    load_history,
    on_component,
    trail,
    write_gaps,
)
from benchmarks.faults.fault_mutants import HOOK_DIR_ENV
from route_cache.record_format import record_key
from routereplay.dev.fault_proxy import FaultProxy
from routereplay.dev.launch import free_ports, stop_process, wait_serving
from routereplay.dev.redis_nodes import RedisProcess, start_cluster_with_replicas
from routereplay.domain.record import Record
from routereplay.errors import RouteReplayError
from routereplay.rpc.client import RetryPolicy, RouteCacheClient

ROOT = Path(__file__).resolve().parents[2]

# The writers' retry budget: the client's defaults (9.4-18.7 s of backoff, pauses of at most
# 0.5 s), what a caller that names none gets.
RETRY = RetryPolicy()
OP_TIMEOUT_S = 5.0
IN_FLIGHT_S = 0.5
RECOVERY_WINDOW_S = 5.0  # an operation counts towards a fault's recovery up to this after heal
READY_STREAM = "rr:ready"  # the route cache's default ready feed
CONSUMER_GROUP = "faultrun"  # the feed consumers' group (fault_consumer.py's default)
FREE_GRACE_S = 3600  # a freed record's expiry: far below the records' 24 h, above the run
MUTATIONS = (
    "early-ack",
    "commit-before-settle",
    "no-aof",
    "trainer-early-ack",
    "claim-apart",  # the claim and its XACK apart (before issue 47): red under kill_between
    # Nodes without AOF (records lost, as no-aof) and the trainer failing a batch whose record
    # is gone (the rule before issue 47): red as a trainer that crash-loops, never finishing.
    "no-dead-letter",
)
# The writers' rate with the real trainer (2 samples/s in all): a megatron step of the tiny
# model takes seconds on 2 loaded cores, so the stand-in's 6 samples/s would outrun it.
MEGATRON_SAMPLE_RATE = 0.5
FEED_SHARD = 0  # the shard whose slots hold the ready stream (checked at the start)
TRAINER_POINTS = {
    "trainer_kill_ack": "after_ack",
    "trainer_kill_step": "after_checkpoint",
    "trainer_kill_mid": "mid_step",
}
TRAINERS = ("stand-in", "megatron")  # fault_trainer.py; python -m trainer (fault_megatron.py)


@dataclass
class FaultConfig:
    """duration_s: how long writers write at least (they go on until the last fault is healed
    and ``tail_s`` more); sample_rate: samples started per second by each writer (open loop);
    turn_gap_s: between a sample's turns; turns: per sample; wait_replicas: the route cache's
    flag; claim_idle_ms: when a consumer takes over another's unacknowledged entries; short:
    the compressed schedule of the test suite; drop_ack: consumer c1 skips one acknowledgement
    (the checker must then fail); mutate: a guarantee removed (``MUTATIONS``; the checker must
    then fail); max_ops: a bound besides the time."""

    duration_s: float = 90.0
    sample_rate: float = 1.5
    turn_gap_s: float = 0.2
    turns: int = 3
    wait_replicas: int = 1
    claim_idle_ms: int = 3000
    node_timeout_ms: int = 1000
    short: bool = False
    drop_ack: bool = False
    mutate: str = ""
    max_ops: int = 8000
    tail_s: float = 3.0
    seed: int = 0
    sync_delay_s: int = 0  # repl-diskless-sync-delay (Redis's default, 5, stalls WAIT)
    schedule: str = ""  # "": SCHEDULES[short]; "soak": a seeded random one (see ``soak``)
    trainer: str = "stand-in"  # ``TRAINERS``: megatron runs ``python -m trainer`` on 2 ranks
    # The route caches' Redis socket time-out (``?socket_timeout=`` in their --redis-url; the
    # service's own is 30 s): above WAIT's 2 s and a feed read's 1 s wait, below a black hole.
    redis_socket_timeout_s: float = 4.0


# (start s, fault, its parameter): the full schedule and the test suite's compressed one.
# Start times are the earliest: each fault waits for the one before it to heal.
SCHEDULES = {
    False: [
        (8, "cache_kill", 3.0),
        (20, "master_failover", 0),
        (36, "master_aof_restart", 1),
        (48, "consumer_stop", 2.0),
        (62, "proxy_delay", 6.0),
        (74, "proxy_drop", 2.0),
        (82, "wait_only", 0),  # shard 0: records and the ready feed's stream
        (96, "proxy_blackhole", 8.0),
        (110, "consumer_kill_between", 1.0),
        (120, "feed_blackhole", 8.0),  # the ready stream's shard: every announcement, read, ack
        (134, "double_failover", 1),  # the stream's shard and a records' shard at once
        (146, "replica_link_mute", 1),
        # The trainer's faults run on a schedule of their own, beside the others.
        (14, "trainer_kill_ack", 0),
        (50, "trainer_kill_step", 0),
        (90, "trainer_kill_mid", 0),
    ],
    True: [
        (2, "cache_kill", 1.5),
        (5, "master_failover", 0),
        (10, "master_aof_restart", 1),
        (13, "consumer_stop", 1.5),
        (18, "proxy_delay", 2.0),
        (21, "proxy_drop", 1.5),
        (24, "wait_only", 0),
        (27, "proxy_blackhole", 6.0),
        (31, "consumer_kill_between", 0.5),
        (34, "feed_blackhole", 6.0),
        (38, "double_failover", 1),
        (42, "replica_link_mute", 2),
        (4, "trainer_kill_ack", 0),
        (14, "trainer_kill_step", 0),
    ],
}
# The component each fault hits (its traffic floor is counted there).
COMPONENT = {
    "cache_kill": "cache0",
    "consumer_stop": "c0",
    "consumer_kill_between": "c0",
    "feed_blackhole": f"shard{FEED_SHARD}",
    "proxy_delay": "all",
    "trainer_kill_ack": "trainer",
    "trainer_kill_step": "trainer",
    "trainer_kill_mid": "trainer",
}


def soak(seconds: float, seed: int, repeats: int = 2) -> list[tuple[float, str, float]]:
    """A seeded random schedule of every fault kind, each at least ``repeats`` times, spread
    over ``seconds`` (each fault still waits for the one before it to heal)."""
    rng = random.Random(seed)
    kinds = [name for _, name, _ in SCHEDULES[False]]
    plan = kinds * repeats
    rng.shuffle(plan)
    params = {name: value for _, name, value in SCHEDULES[False]}
    shards = dict.fromkeys(
        (
            "master_failover",
            "master_aof_restart",
            "wait_only",
            "double_failover",
            "replica_link_mute",
        ),
        3,
    )
    step = seconds / (len(plan) + 1)
    out = []
    for i, name in enumerate(plan):
        value = rng.randrange(shards[name]) if name in shards else params[name]
        out.append((round(step * (i + 0.5) + rng.uniform(0, step / 2), 1), name, value))
    return out


class Environment:
    """The cluster behind its proxies, the two route caches and the two consumers."""

    def __init__(self, config: FaultConfig, workdir: Path, start: float):
        self.config, self.workdir, self.start = config, workdir, start
        self.proxies: dict[int, FaultProxy] = {}  # node port -> its proxy
        self.masters: list[RedisProcess] = []
        self.replicas: list[RedisProcess] = []
        self.slots: list[set[int]] = []  # shard -> its slots (a failover keeps them)
        self.cache_ports = free_ports(2)
        self.caches: list[subprocess.Popen | None] = [None, None]
        self.consumers: list[subprocess.Popen] = []
        self.stop_file = workdir / "stop"
        self.trainer: subprocess.Popen | None = None
        self.trainer_fault = False  # a trainer kill in progress: the supervisor waits
        self.pause_dir = workdir / "pause"
        self.pause_dir.mkdir()
        self.hook_dir = workdir / "hooks"  # the route caches' hook (``fault_mutants.between``)
        self.hook_dir.mkdir()

    @property
    def target(self) -> str:
        return "ipv4:" + ",".join(f"127.0.0.1:{p}" for p in self.cache_ports)

    def _node(self) -> RedisProcess:
        """A cluster node with an append-only file (unless ``no-aof``), announcing its
        proxy's port."""
        aof = "no" if self.config.mutate in ("no-aof", "no-dead-letter") else "yes"
        node = RedisProcess(
            "--appendonly",
            aof,
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
        for master in self.masters:
            client = redis.Redis(port=master.port)
            myid = client.execute_command("CLUSTER MYID").decode()
            self.slots.append(
                {
                    slot
                    for a, b, owner, *_ in client.execute_command("CLUSTER SLOTS")
                    if owner[2].decode() == myid
                    for slot in range(a, b + 1)
                }
            )
        if key_slot(READY_STREAM.encode()) not in self.slots[FEED_SHARD]:
            raise RuntimeError(f"the ready stream is not on shard {FEED_SHARD}")

    def shard_of(self, sample_id: str) -> int:
        slot = key_slot(record_key(sample_id).encode())
        return next(i for i, slots in enumerate(self.slots) if slot in slots)

    def start_cache(self, i: int) -> None:
        seed = self.proxies[self.masters[1].port].port
        patches = "hooks"  # the point c0 is killed at (consumer_kill_between)
        if self.config.mutate in ("early-ack", "claim-apart"):
            patches += f",{self.config.mutate}"
        module = ["-m", "benchmarks.faults.fault_mutants", patches]
        args = [
            sys.executable,
            *module,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.cache_ports[i]),
            "--redis-url",
            f"redis://127.0.0.1:{seed}?socket_timeout={self.config.redis_socket_timeout_s:g}",
            "--redis-cluster",
            "--wait-replicas",
            str(self.config.wait_replicas),
            "--grace-s",
            "1",
            "--health-interval-s",
            "0.2",
            # The lifecycle under fire: a record is freed once both groups committed it; a
            # long grace keeps it for the final read, which tells freed from not by its expiry.
            "--commit-groups",
            f"{CONSUMER_GROUP},{TRAINER}",
            "--free-grace-s",
            str(FREE_GRACE_S),
        ]
        env = {**os.environ, HOOK_DIR_ENV: str(self.hook_dir)}
        with open(self.workdir / f"cache{i}.log", "ab") as log:
            proc = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, process_group=0, cwd=ROOT, env=env
            )
        wait_serving(f"127.0.0.1:{self.cache_ports[i]}", proc, 30)
        self.caches[i] = proc

    def start_consumers(self) -> None:
        for i in range(2):
            self.consumers.append(self.start_consumer(i))

    def start_consumer(self, i: int) -> subprocess.Popen:
        """Consumer ``c<i>`` (again, after a kill: its history goes on in the same file)."""
        args = [
            sys.executable,
            "-m",
            "benchmarks.faults.fault_consumer",
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
        if self.config.mutate == "commit-before-settle":
            args += ["--commit-before-settle"]
        with open(self.workdir / f"c{i}.log", "ab") as log:
            return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)

    def start_trainer(self) -> None:
        """The trainer (``fault_trainer.py``, or ``python -m trainer`` through
        ``fault_megatron.py``), resuming from its checkpoints."""
        if self.config.trainer == "megatron":
            args = fault_megatron.command(self.workdir, self.target, self.start)
        else:
            args = [
                *(sys.executable, "-m", "benchmarks.faults.fault_trainer", "--target", self.target),
                *("--history", str(self.workdir / "trainer.jsonl")),
                *("--checkpoint-dir", str(self.workdir / "checkpoints")),
                *("--pause-dir", str(self.pause_dir), "--stop-file", str(self.stop_file)),
                *("--start", repr(self.start), "--step-s", "0.02"),
            ]
        if self.config.mutate == "trainer-early-ack":
            args += ["--mutate", "early-ack"]
        if self.config.mutate == "no-dead-letter":
            args += ["--mutate", "no-dead-letter"]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        env.pop("WORLD_SIZE", None)
        with open(self.workdir / "trainer.log", "ab") as log:
            self.trainer = subprocess.Popen(
                args, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env
            )

    def pair(self, shard: int) -> tuple[RedisProcess, RedisProcess]:
        return self.masters[shard], self.replicas[shard]

    def master_of(self, shard: int) -> RedisProcess:
        """The node that is master of ``shard`` now (a failover swaps the pair)."""
        for node in self.pair(shard):
            if _role(node).get("role") == "master":
                return node
        raise RuntimeError(f"shard {shard} has no master")

    def replica_of(self, shard: int, master: RedisProcess) -> RedisProcess:
        return next(n for n in self.pair(shard) if n is not master)

    def restart_node(self, node: RedisProcess) -> None:
        node.start()  # same port and directory: it reloads its append-only file
        redis.Redis(port=node.port).config_set("cluster-node-timeout", self.config.node_timeout_ms)

    def freed(self, sample_ids: list[str]) -> dict[str, bool]:
        """Whether the route cache freed each sample's record: its expiry is within the grace
        (a record not freed lives out the route cache's 24 h time to live)."""
        node = self.proxies[self.master_of(0).port].port
        client = redis.cluster.RedisCluster(host="127.0.0.1", port=node, socket_timeout=10)
        try:
            pipe = client.pipeline(transaction=False)
            for sample_id in sample_ids:
                pipe.pttl(record_key(sample_id))
            ttls = pipe.execute()
        finally:
            client.close()
        grace = FREE_GRACE_S * 1000
        return {s: 0 < ttl <= grace for s, ttl in zip(sample_ids, ttls, strict=True)}

    def feed_state(self) -> dict:
        """The ready feed's consumer groups (pending, lag, consumers), its length."""
        node = self.proxies[self.master_of(0).port].port
        client = redis.cluster.RedisCluster(host="127.0.0.1", port=node, socket_timeout=10)
        try:
            groups = client.xinfo_groups(READY_STREAM)
            return {
                "length": client.xlen(READY_STREAM),
                "groups": [
                    {
                        "name": _text(g["name"]),
                        "pending": g["pending"],
                        "lag": g.get("lag"),
                        "consumers": g["consumers"],
                        "last_delivered": _text(g["last-delivered-id"]),
                        "pending_ids": [
                            _text(p["message_id"])
                            for p in client.xpending_range(
                                READY_STREAM, g["name"], min="-", max="+", count=100
                            )
                        ],
                    }
                    for g in groups
                ],
            }
        finally:
            client.close()

    def stop(self) -> None:
        self.stop_file.touch()
        for proc in [*self.consumers, self.trainer]:
            if proc is None:
                continue
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
        if self.trainer is not None:  # torchrun's ranks, should it have left any
            kill_tree(self.trainer)
        for proc in self.caches:
            if proc is not None:
                stop_process(proc, 5)
        for node in self.masters + self.replicas:
            node.kill()
        for proxy in self.proxies.values():
            proxy.close()


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


# --- traffic ----------------------------------------------------------------------------------


class Traffic:
    """What the load has in flight, per component (``shardN``, ``cache0``), and which samples
    each shard has acknowledged (for the readers); the nemesis injects a fault only while an
    operation on its component is in flight."""

    def __init__(self):
        self._cond = threading.Condition()
        self.busy: Counter[str] = Counter()
        self.started: Counter[str] = Counter()
        self.acked: dict[int, dict[str, int]] = {}  # shard -> sample -> turns acknowledged
        self.acks: Counter[int] = Counter()  # shard -> writes and appends acknowledged

    @contextlib.contextmanager
    def op(self, components: list[str]):
        with self._cond:
            for c in components:
                self.busy[c] += 1
                self.started[c] += 1
            self._cond.notify_all()
        try:
            yield
        finally:
            with self._cond:
                for c in components:
                    self.busy[c] -= 1

    def wait_busy(self, component: str, timeout_s: float) -> bool:
        """Until an operation on ``component`` (``all``: any) starts: injected then, the fault
        meets it in flight (one found already running may be about to end)."""

        def count() -> int:
            if component == "all":
                return sum(self.started.values())
            return self.started[component]

        with self._cond:
            base = count()
            return self._cond.wait_for(lambda: count() > base, timeout_s)

    def wait_started(self, component: str, count: int, timeout_s: float) -> int:
        """Until ``count`` more operations on ``component`` have started; returns how many."""
        with self._cond:
            base = self.started[component]
            self._cond.wait_for(lambda: self.started[component] - base >= count, timeout_s)
            return self.started[component] - base

    def acknowledge(self, shard: int, sample_id: str, turns: int) -> None:
        with self._cond:
            self.acked.setdefault(shard, {})[sample_id] = turns
            self.acks[shard] += 1
            self._cond.notify_all()

    def wait_acked(self, shard: int, timeout_s: float) -> bool:
        """Until a write or append on ``shard`` is acknowledged from now on."""
        with self._cond:
            base = self.acks[shard]
            return self._cond.wait_for(lambda: self.acks[shard] > base, timeout_s)

    def sample(self, shard: int, count: int, rng: random.Random) -> dict[str, int]:
        with self._cond:
            got = self.acked.get(shard, {})
            ids = rng.sample(sorted(got), min(count, len(got)))
            return {s: got[s] for s in ids}


# --- faults -----------------------------------------------------------------------------------


def _role(node: RedisProcess) -> dict:
    try:
        return redis.Redis(port=node.port, socket_timeout=1).info("replication")
    except redis.RedisError:
        return {}


def _process_state(proc: subprocess.Popen) -> str:
    """The kernel's state letter of ``proc`` (T: stopped)."""
    return Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _ping_s(port: int, timeout_s: float = 2.0) -> float:
    """Seconds a PING through ``port`` takes on a connection opened first; raises when it
    cannot be opened or answered."""
    client = redis.Redis(
        port=port,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 0),  # redis-py retries by default: one try, as probed
    )
    try:
        client.ping()
        started = time.monotonic()
        client.ping()
        return time.monotonic() - started
    finally:
        client.close()


def component_of(name: str, value: float) -> str:
    """The component fault ``name`` hits: its traffic floor is counted there."""
    if name in COMPONENT:
        return COMPONENT[name]
    if name in ("proxy_drop", "proxy_blackhole"):
        return "shard2"
    return f"shard{int(value)}"


def cut_off_replica(master: RedisProcess, replica: RedisProcess) -> None:
    """Cut ``replica`` off its master, as in a network partition between the two (as
    ``tests/route_cache/test_faults_redis.py`` does): the master asks for a password the
    replica lacks and drops its replication link, so it cannot resync. Open connections (the
    route caches') stay signed in; the cluster bus is untouched, so a failover still happens.
    Raises when the replica is still linked 10 s later."""
    client = redis.Redis(port=master.port)
    client.config_set("requirepass", "cut-off")
    client.client_kill_filter(_type="replica")
    wait_until(
        lambda: _role(replica).get("master_link_status") == "down", 10, "the replica's cut-off"
    )


def inject(env: Environment, name: str, value: float, mark) -> dict:
    """Run fault ``name`` (inject, check its effect, wait, heal); returns details to log with
    it. ``mark()`` is called right before the injection: it waits until an operation on the
    fault's component is in flight and notes the moment. Raises when the fault or its effect
    did not happen."""
    if name == "cache_kill":
        proc = env.caches[0]
        mark()
        proc.kill()  # SIGKILL
        if proc.wait() != -signal.SIGKILL:
            raise RuntimeError(f"route cache 0 ended with {proc.returncode}, not by SIGKILL")
        time.sleep(value)
        env.start_cache(0)
        return {"down_s": value}
    if name == "master_failover":
        victim = env.master_of(int(value))
        heir = env.replica_of(int(value), victim)
        started = time.monotonic()
        mark()
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
        replica = env.replica_of(int(value), victim)
        started = time.monotonic()
        mark()
        victim.kill()
        time.sleep(0.3)
        env.restart_node(victim)
        role, replica_role = _role(victim).get("role"), _role(replica).get("role")
        if role != "master" or replica_role != "slave":
            raise RuntimeError(
                f"after the restart the node is {role!r} and its replica {replica_role!r}: "
                "the cluster failed over, so the append-only file was not what restored it"
            )
        wait_until(lambda: _role(replica).get("master_link_status") == "up", 30, "resync")
        # Healed when the shard acknowledges writes again (a restarted master refuses them
        # for about 2 s while it learns the cluster's configuration).
        if not env.traffic.wait_acked(int(value), 15):
            raise RuntimeError("the restarted master's shard acknowledged no write in 15 s")
        return {
            "node": victim.port,
            "role_after": role,
            "writable_s": round(time.monotonic() - started, 2),
            "replica_linked_s": round(time.monotonic() - started, 2),
        }
    if name == "consumer_stop":
        consumer = env.consumers[0]
        stopped_s = env.config.claim_idle_ms / 1000 + value
        log = env.workdir / "c0.jsonl"
        deadline = time.monotonic() + 15
        tries = 0
        while True:  # stop it while it holds a batch (delivered, not settled)
            last = _last_op(log)
            if last == "deliver":
                mark()
                consumer.send_signal(signal.SIGSTOP)
                time.sleep(0.05)
                if _last_op(log) == "deliver":
                    break
                consumer.send_signal(signal.SIGCONT)  # it settled first: try again
                tries += 1
            if time.monotonic() > deadline:
                raise RuntimeError(f"consumer c0 never held a batch when stopped ({tries} tries)")
            time.sleep(0.002)
        state = _process_state(consumer)
        if state != "T":
            consumer.send_signal(signal.SIGCONT)
            raise RuntimeError(f"consumer c0 is in state {state!r} after SIGSTOP, not stopped")
        time.sleep(stopped_s)
        consumer.send_signal(signal.SIGCONT)
        return {"consumer": "c0", "stopped_s": stopped_s, "retries": tries}
    if name == "proxy_delay":
        probe = env.proxies[env.master_of(0).port].port
        mark()
        for proxy in env.proxies.values():
            proxy.delay_s = 0.1
        try:
            probed = _ping_s(probe)
        finally:
            time.sleep(value)
            for proxy in env.proxies.values():
                proxy.delay_s = 0.0
        if probed < 0.15:
            raise RuntimeError(f"a PING through a delaying proxy took {probed:.3f} s, not 0.2")
        return {"delay_ms": 100, "s": value, "probe_ping_s": round(probed, 3)}
    if name == "proxy_drop":
        victim = env.master_of(2)
        proxy = env.proxies[victim.port]
        before = proxy.dropped
        mark()
        proxy.drop(value)
        try:
            _ping_s(proxy.port, 0.5)
            refused = False
        except redis.RedisError:
            refused = True
        time.sleep(value)
        reset = proxy.dropped - before
        if not refused or not reset:
            raise RuntimeError(
                f"the proxy did not cut: {reset} connections reset, new ones "
                f"{'refused' if refused else 'answered'}"
            )
        return {"node": victim.port, "refused_s": value, "reset": reset}
    if name == "proxy_blackhole":
        return blackhole(env, value, mark, 2)
    if name == "feed_blackhole":
        return blackhole(env, value, mark, FEED_SHARD)
    if name == "consumer_kill_between":
        return kill_between(env, value, mark)
    if name == "double_failover":
        return double_failover(env, int(value), mark)
    if name == "replica_link_mute":
        return mute_replica_link(env, int(value), mark)
    if name in TRAINER_POINTS:
        return kill_trainer(env, name, mark)
    if name == "wait_only":
        shard = int(value)
        victim = env.master_of(shard)
        heir = env.replica_of(shard, victim)
        started = time.monotonic()
        mark()
        cut_off_replica(victim, heir)
        # Writes to the shard go on meanwhile: acknowledged here only without WAIT.
        during_cut = env.traffic.wait_started(f"shard{shard}", 4, 3.0)
        cut_s = time.monotonic() - started
        victim.kill()
        wait_until(lambda: _role(heir).get("role") == "master", 30, "the replica's promotion")
        failover_s = time.monotonic() - started
        env.restart_node(victim)  # without the password: CONFIG SET is not kept
        wait_until(lambda: _role(victim).get("master_link_status") == "up", 30, "resync")
        return {
            "node": victim.port,
            "cut_s": round(cut_s, 2),
            "started_during_cut": during_cut,
            "failover_s": round(failover_s, 2),
            "replica_linked_s": round(time.monotonic() - started, 2),
        }
    raise ValueError(name)


def kill_between(env: Environment, down_s: float, mark) -> dict:
    """Consumer c0 is killed at the route cache's hook between its settle claim and its XACK
    (``fault_mutants.between``: the next acknowledgement c0 sends is held there), and stays
    down past the stand-by's ``claim_idle_ms`` (+ ``down_s``), so that c1 takes over what it
    held; then it starts again under its name, as a supervisor would. Checked: the hook held
    an acknowledgement of c0's, and c0 ended by SIGKILL."""
    trigger, held = env.hook_dir / "between", env.hook_dir / "between.held"
    consumer = env.consumers[0]
    trigger.touch()
    try:
        wait_until(held.exists, 20, "an acknowledgement of c0's held at the hook")
    except Exception:
        trigger.unlink(missing_ok=True)
        raise
    mark()  # c0 holds its batch now: delivered, trained, its settle held (the floor counts it)
    consumer.kill()
    code = consumer.wait()
    held.unlink()  # the held call now fails: nothing after the point happened
    if code != -signal.SIGKILL:
        raise RuntimeError(f"consumer c0 ended with {code}, not by SIGKILL")
    stopped_s = env.config.claim_idle_ms / 1000 + down_s
    time.sleep(stopped_s)
    env.consumers[0] = env.start_consumer(0)
    return {"consumer": "c0", "down_s": round(stopped_s, 2)}


def double_failover(env: Environment, shard: int, mark) -> dict:
    """The masters of the ready stream's shard and of records' shard ``shard`` (another one
    if that is the stream's) both down at once: the stream's killed, and the records' killed
    as soon as the stream's replica is promoted (two of three masters down together get no
    failover: Redis Cluster needs a majority of masters to agree that one failed; found by
    the first try, which killed both at once and waited 30 s for nothing). Both old masters
    come back as replicas once both replicas are promoted. Checked: both promotions and
    both resyncs."""
    if shard == FEED_SHARD:
        shard = (shard + 1) % len(env.masters)
    shards = (FEED_SHARD, shard)
    victims = [env.master_of(s) for s in shards]
    heirs = [env.replica_of(s, v) for s, v in zip(shards, victims, strict=True)]
    started = time.monotonic()
    mark()
    for victim, heir in zip(victims, heirs, strict=True):
        victim.kill()
        wait_until(lambda h=heir: _role(h).get("role") == "master", 30, "a replica's promotion")
    failover_s = time.monotonic() - started
    for victim in victims:
        env.restart_node(victim)
    for victim in victims:
        wait_until(lambda v=victim: _role(v).get("master_link_status") == "up", 30, "resync")
    return {
        "shards": list(shards),
        "nodes": [v.port for v in victims],
        "failover_s": round(failover_s, 2),
        "replica_linked_s": round(time.monotonic() - started, 2),
    }


REPL_TIMEOUT_S = 3  # the muted link's ends notice within this (Redis's default: 60 s)


def _replica_links(master: redis.Redis) -> list[dict]:
    """The master's replicas as ``INFO replication`` gives them (``port``: the replica's own;
    ``lag``: seconds since its last acknowledgement)."""
    info = master.info("replication")
    return [v for k, v in info.items() if k.startswith("slave") and isinstance(v, dict)]


def mute_replica_link(env: Environment, shard: int, mark) -> dict:
    """The replication link of shard ``shard`` dies silently: its proxy passes nothing more on
    that one connection, closes nothing and resets nothing (``FaultProxy.mute``); every other
    connection to the master is untouched. ``WAIT``ed writes to the shard fail until the ends'
    ``repl-timeout`` notices (lowered to 3 s on the pair for the fault, restored after) and the
    replica links again on a new connection. Checked: the muted connection was the replica's
    (found through ``CLIENT LIST``), the replica's acknowledgements stopped (its lag grew past
    2 s), and it linked again on a new connection."""
    victim = env.master_of(shard)
    replica = env.replica_of(shard, victim)
    proxy = env.proxies[victim.port]
    master, follower = redis.Redis(port=victim.port), redis.Redis(port=replica.port)
    for node in (master, follower):
        node.config_set("repl-timeout", REPL_TIMEOUT_S)
    master.config_set("repl-ping-replica-period", 1)
    try:
        (link,) = master.client_list(_type="replica")
        port = int(link["addr"].rsplit(":", 1)[1])
        started = time.monotonic()
        mark()
        if not proxy.mute(port):
            raise RuntimeError(f"the replica's link (port {port}) is not open through the proxy")
        wait_until(
            lambda: (
                any(r["lag"] >= 2 for r in _replica_links(master)) or not _replica_links(master)
            ),
            15,
            "the muted replica's acknowledgements to stop",
        )
        stalled_s = time.monotonic() - started

        def linked_anew() -> bool:
            links = master.client_list(_type="replica")
            fresh = [c for c in links if int(c["addr"].rsplit(":", 1)[1]) != port]
            return bool(fresh) and _role(replica).get("master_link_status") == "up"

        wait_until(linked_anew, 30, "the replica's new link")
        return {
            "node": victim.port,
            "muted_port": port,
            "stalled_s": round(stalled_s, 2),
            "relinked_s": round(time.monotonic() - started, 2),
        }
    finally:
        for node in (master, follower):
            node.config_set("repl-timeout", 60)
        master.config_set("repl-ping-replica-period", 10)
        master.close()
        follower.close()


def blackhole(env: Environment, seconds: float, mark, shard: int) -> dict:
    """Shard ``shard``'s master's proxy black-holes for ``seconds``: nothing passes either way, on
    open connections, the replica's link and new connections alike; no RST, no FIN; what was
    sent comes through afterwards, as TCP would resend it. ``seconds`` must outlast the route
    caches' Redis socket time-out, so that they meet it. Checked: a PING through the proxy, on
    a connection opened during the black hole, times out rather than failing fast or being
    answered; at least one open connection (a route cache's) was silenced, and at least one of
    those was given up by its client (closed: a socket time-out met). Healed when the shard
    acknowledges a write again; raises if that takes over the socket time-out + 10 s."""
    victim = env.master_of(shard)
    proxy = env.proxies[victim.port]
    before, gave_up = proxy.black_holed, proxy.given_up
    started = time.monotonic()
    mark()
    proxy.blackhole(seconds)
    probe_s = min(1.0, seconds / 4)
    try:
        _ping_s(proxy.port, probe_s)
        outcome = "answered"
    except redis.TimeoutError:
        outcome = "timed out"
    except redis.RedisError as exc:
        outcome = f"failed fast ({type(exc).__name__})"
    probed_s = time.monotonic() - started
    silenced = proxy.black_holed - before
    time.sleep(max(0.0, seconds - (time.monotonic() - started)))
    if outcome != "timed out" or probed_s < probe_s or not silenced:
        raise RuntimeError(
            f"the proxy did not black-hole: a PING through it {outcome} after {probed_s:.2f} s, "
            f"{silenced} open connections silenced"
        )
    ended = time.monotonic()
    socket_timeout_s = env.config.redis_socket_timeout_s
    if not env.traffic.wait_acked(shard, socket_timeout_s + 10):
        raise RuntimeError(
            f"shard {shard} acknowledged no write within {socket_timeout_s + 10:.0f} s of the "
            "black hole's end"
        )
    writable_s = time.monotonic() - ended
    time.sleep(max(0.0, ended + 0.5 - time.monotonic()))  # the ends' FINs pass on
    given_up = proxy.given_up - gave_up
    if not given_up:
        raise RuntimeError(
            f"no client gave up any of the {silenced} connections the black hole silenced: "
            "no socket time-out was met"
        )
    return {
        "node": victim.port,
        "s": seconds,
        "silenced": silenced,
        "given_up": given_up,
        "probe": f"{outcome} after {probed_s:.2f} s",
        "writable_after_s": round(writable_s, 2),
    }


def kill_trainer(env: Environment, name: str, mark) -> dict:
    """SIGKILL the trainer where ``name`` says (``TRAINER_POINTS``: it stops itself there when
    asked), start it again, and heal once the new process has taken a batch."""
    point = TRAINER_POINTS[name]
    log = env.workdir / "trainer.jsonl"
    env.trainer_fault = True
    try:
        proc = env.trainer
        (env.pause_dir / point).touch()
        wait_until(  # it logs ``paused``, then stops itself (the lead rank, under torchrun)
            lambda: proc.poll() is not None or (_last_entry(log) or {}).get("op") == "paused",
            120,
            f"the trainer's stop at {point}",
        )
        last = _last_entry(log) or {}
        if proc.poll() is not None or last.get("op") != "paused" or last.get("point") != point:
            raise RuntimeError(f"the trainer did not stop at {point}: {last}, rc {proc.poll()}")
        mark()
        kill_tree(proc)
        if proc.wait() != -signal.SIGKILL:
            raise RuntimeError(f"the trainer ended with {proc.returncode}, not by SIGKILL")
        lives = _count_ops(log, "resume")
        env.start_trainer()

        def resumed() -> bool:  # a start that dies before it resumes is started again
            if env.trainer.poll() is not None and _count_ops(log, "resume") <= lives:
                env.start_trainer()
            return _count_ops(log, "resume") > lives

        wait_until(resumed, 120, "the trainer's restart")
        resumed = _last_of(log, "resume")
        wait_until(lambda: _last_entry(log)["op"] not in ("resume", "ack"), 60, "a new batch")
        return {
            "point": point,
            "step": last["step"],
            "resumed_after": resumed["steps_done"],
            "discarded_steps": resumed["discarded_steps"],
        }
    finally:
        (env.pause_dir / point).unlink(missing_ok=True)
        env.trainer_fault = False


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and every process under it (torchrun starts its ranks in sessions of
    their own: its process group does not hold them)."""
    import psutil

    with contextlib.suppress(psutil.NoSuchProcess):
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.kill()
        for child in children:
            with contextlib.suppress(psutil.NoSuchProcess):
                child.kill()


def supervise(env: Environment, history: History, stop: threading.Event) -> None:
    """Restart the trainer when it dies on its own (a job's supervisor), until the end."""
    while not stop.wait(0.5):
        proc = env.trainer
        if env.trainer_fault or env.stop_file.exists() or proc is None or proc.poll() is None:
            continue
        history.log("trainer_exit", rc=proc.returncode)
        env.start_trainer()


def _lines(path: Path) -> list[dict]:
    try:
        text = path.read_text()
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


def _last_entry(path: Path) -> dict | None:
    lines = _lines(path)
    return lines[-1] if lines else None


def _count_ops(path: Path, op: str) -> int:
    return sum(e["op"] == op for e in _lines(path))


def _last_of(path: Path, op: str) -> dict:
    return [e for e in _lines(path) if e["op"] == op][-1]


def _last_op(path: Path) -> str | None:
    """The ``op`` of the last complete line of a consumer's history."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 4096))
            lines = [x for x in f.read().split(b"\n") if x.strip()]
    except OSError:
        return None
    for line in reversed(lines):
        with contextlib.suppress(ValueError):
            return json.loads(line)["op"]
    return None


def nemesis(env: Environment, history: History, schedule, stop: threading.Event) -> None:
    for at, name, value in schedule:
        while history.now() < at:
            if stop.wait(0.05):
                return
        component = component_of(name, value)
        began = history.now()
        injected: list[float] = []

        def mark(component=component, injected=injected) -> None:
            if not is_consumer(component):  # a consumer fault waits for a held batch itself
                env.traffic.wait_busy(component, 10)
            injected.append(history.now())

        try:
            detail = inject(env, name, value, mark)
        except Exception as exc:  # noqa: BLE001 - logged; the checker fails the run on it
            detail = {"error": repr(exc)}
        history.log(
            "fault",
            t=round(injected[-1] if injected else began, 4),
            name=name,
            component=component,
            began=round(began, 3),
            end=round(history.now(), 3),
            detail=detail,
        )


# --- load -------------------------------------------------------------------------------------


def sample_ids(env: Environment, prefix: str, shard: int | None):
    """Sample ids ``prefix-i``, only those of ``shard`` (None: any)."""
    i = 0
    while True:
        sample_id = f"{prefix}-{i}"
        i += 1
        if shard is None or env.shard_of(sample_id) == shard:
            yield sample_id


def run_sample(client, env, history, config, sample_id, via, started_at) -> None:
    """One sample's turns in order, turn k not before ``started_at + k * turn_gap_s``; a
    turn that fails ends the sample (its later turns are never attempted)."""
    shard = env.shard_of(sample_id)
    components = [f"shard{shard}"] + ([via] if via != "any" else [])
    for turn in range(config.turns):
        time.sleep(max(0.0, started_at + turn * config.turn_gap_s - time.monotonic()))
        final = turn == config.turns - 1
        start = history.now()
        with env.traffic.op(components):
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
            shard=shard,
            via=via,
        )
        if not ok:
            return
        env.traffic.acknowledge(shard, sample_id, turn + 1)


def writer(name, env, history, config, ids, target, via, ops, deadline) -> None:
    """Open loop: a new sample every ``1 / sample_rate`` seconds on a fixed clock, each in its
    own thread, whatever became of the earlier ones (a fault does not slow the offered load)."""
    period = 1.0 / config.sample_rate
    threads = []
    with RouteCacheClient(target, timeout_s=OP_TIMEOUT_S, retry=RETRY) as client:
        next_at = time.monotonic() + random.Random(name).uniform(0, period)
        while True:
            time.sleep(max(0.0, next_at - time.monotonic()))
            next_at += period
            if deadline() or ops[0] >= config.max_ops:
                break
            ops[0] += config.turns
            thread = threading.Thread(
                target=run_sample,
                args=(client, env, history, config, next(ids), via, time.monotonic()),
                daemon=True,
            )
            thread.start()
            threads.append(thread)
        for thread in threads:
            thread.join(60)


def reader(shard, env, history, config, target, deadline, period_s=0.5) -> None:
    """Every ``period_s``, read back up to 4 samples of ``shard`` already acknowledged and log
    what came back (turns held and digest) against the turns acknowledged before."""
    rng = random.Random(shard)
    with RouteCacheClient(target, timeout_s=OP_TIMEOUT_S, retry=RETRY) as client:
        next_at = time.monotonic()
        while not deadline():
            time.sleep(max(0.0, next_at - time.monotonic()))
            next_at = max(next_at + period_s, time.monotonic())
            want = env.traffic.sample(shard, 4, rng)
            if not want:
                continue
            start = history.now()
            with env.traffic.op([f"shard{shard}"]):
                try:
                    items = client.read_batch(sorted(want), skip_missing=True)
                    got = [
                        [
                            item.sample_id,
                            len(item.turns) if isinstance(item, Record) else 0,
                            digest(item) if isinstance(item, Record) else None,
                            want[item.sample_id],
                        ]
                        for item in items
                    ]
                    ok, status = True, None
                except RouteReplayError as exc:
                    got, ok, status = [], False, exc.status
            history.log(
                "read",
                t=round(start, 4),
                shard=shard,
                via="any",
                ok=ok,
                status=status,
                ms=round((history.now() - start) * 1000, 2),
                got=got,
            )


def read_stored(target: str):
    """``stored(ids)``: the records the route cache holds now."""

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
    """Availability (by operations, and by time: the longest write gap per shard), latency
    outside and during each fault (its span plus ``after_s``), recovery per fault, and the
    feed's publish-to-train delay."""
    ops = [e for e in history if e["op"] in WRITES]
    # The trainer's faults run beside the others and touch no write: not in the attribution.
    faults = [e for e in history if e["op"] == "fault" and e["name"] not in TRAINER_POINTS]
    spans = [(f["t"], f["end"] + after_s) for f in faults]
    outside = [e["ms"] for e in ops if e["ok"] and not any(a <= e["t"] < b for a, b in spans)]
    base_p99 = float(np.percentile(outside, 99)) if outside else 100.0
    # Slow: 3 x the fault-free p99, between 250 ms and 1 s (a short run has few operations
    # outside its faults, and their p99 can be a fault's tail).
    slow_ms = min(max(3 * base_p99, 250.0), 1000.0)
    # An operation on a fault's component that failed or was slow counts against the last
    # fault that began before it did (or within ``IN_FLIGHT_S`` after: it was in flight when
    # the fault hit), if it began before that fault's heal plus ``RECOVERY_WINDOW_S``; a
    # fault's recovery ends when the last such operation does.
    recovered = [0.0] * len(faults)
    for e in ops:
        hit = [i for i, f in enumerate(faults) if f["t"] <= e["t"] + IN_FLIGHT_S]
        if not hit or not (not e["ok"] or e["ms"] > slow_ms):
            continue
        f = faults[hit[-1]]
        component = f.get("component", "all")
        if e["t"] <= f["end"] + RECOVERY_WINDOW_S and (
            is_consumer(component) or on_component(component, e)
        ):
            end = e["t"] + e["ms"] / 1000
            recovered[hit[-1]] = max(recovered[hit[-1]], end - f["t"])
    per_fault = []
    for f, recovery in zip(faults, recovered, strict=True):
        during = [e for e in ops if f["t"] <= e["t"] < f["end"] + after_s]
        component = f.get("component", "all")
        gap = None
        if component.startswith("shard"):
            window = (f["t"], f["end"] + RECOVERY_WINDOW_S)
            gap = write_gaps(history, window).get(int(component[5:]), (None,))[0]
        per_fault.append(
            {
                "fault": f["name"],
                "component": component,
                "start_s": f["t"],
                "healed_s": round(f["end"] - f["t"], 2),
                "detail": f["detail"],
                "ops": len(during),
                "failed": sum(not e["ok"] for e in during),
                **_pcts([e["ms"] for e in during if e["ok"]]),
                "recovery_s": round(recovery, 2),
                "after_heal_s": round(max(0.0, recovery - (f["end"] - f["t"])), 2),
                "write_gap_s": gap,
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
        "write_gap_per_shard_s": {str(k): v for k, v in write_gaps(history).items()},
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

    ops = [e for e in history if e["op"] in WRITES]
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
    """One fault run; the merged history, final read and feed state included, goes to
    ``out/faults-history.jsonl``. Returns the verdict, its lines and the figures."""
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(tempfile.mkdtemp(prefix="rr-faultrun-"))
    start = time.time()
    history = History(workdir / "driver.jsonl", "driver", start)
    history.log("config", **asdict(config))
    env = Environment(config, workdir, start)
    env.traffic = Traffic()
    stop = threading.Event()
    prefix = f"fr-{uuid.uuid4().hex[:6]}"
    consumer_logs = [workdir / f"{n}.jsonl" for n in ("c0", "c1", "trainer", "trainer-r1")]
    try:
        env.start_redis()
        env.start_cache(0)
        env.start_cache(1)
        env.start_consumers()
        env.start_trainer()
        t0 = history.now()
        plan = soak(config.duration_s, config.seed) if config.schedule == "soak" else None
        schedule = [(t0 + at, name, value) for at, name, value in plan or SCHEDULES[config.short]]
        # The trainer's faults on a nemesis of their own (a restart takes 10-20 s).
        chaos_threads = [
            threading.Thread(
                target=nemesis,
                args=(env, history, [x for x in schedule if (x[1] in TRAINER_POINTS) == t], stop),
            )
            for t in (False, True)
        ]
        chaos_threads.append(threading.Thread(target=supervise, args=(env, history, stop)))
        for thread in chaos_threads:
            thread.start()
        healed: list[float] = []

        def deadline() -> bool:  # the writers stop: time is up and every fault is healed
            if any(t.is_alive() for t in chaos_threads[:2]):
                return False
            if history.now() < t0 + config.duration_s:
                return False
            healed[:] = healed or [history.now()]
            return history.now() >= healed[0] + config.tail_s

        ops = [0]
        local = f"ipv4:127.0.0.1:{env.cache_ports[0]}"
        load = [
            threading.Thread(
                target=writer,
                args=(
                    f"w{s}",
                    env,
                    history,
                    config,
                    sample_ids(env, f"{prefix}-s{s}", s),
                    env.target,
                    "any",
                    ops,
                    deadline,
                ),
            )
            for s in range(3)
        ]
        load.append(
            threading.Thread(
                target=writer,
                args=(
                    "wc",
                    env,
                    history,
                    config,
                    sample_ids(env, f"{prefix}-c0", None),
                    local,
                    "cache0",
                    ops,
                    deadline,
                ),
            )
        )
        load += [
            threading.Thread(target=reader, args=(s, env, history, config, env.target, deadline))
            for s in range(3)
        ]
        for thread in load:
            thread.start()
        for thread in load:
            thread.join()
        for thread in chaos_threads[:2]:
            thread.join()
        drain(env, history, config, consumer_logs, f"{prefix}-fill")
        time.sleep(config.claim_idle_ms / 1000 + 1)  # room for a late double train to show
        env.stop_file.touch()
        for proc in [*env.consumers, env.trainer]:
            proc.wait(60)
        attempted = sorted({e["sample"] for e in history.entries if e["op"] in WRITES})
        final = final_entries(read_stored(env.target)(attempted), env.freed(attempted))
        feed = env.feed_state()
    finally:
        stop.set()
        history.close()
        env.stop()
    entries = load_history([workdir / "driver.jsonl", *consumer_logs])
    entries += [{**e, "t": round(history.now(), 3)} for e in final]
    entries.append({"t": round(history.now(), 3), "proc": "final", "op": "feed_state", **feed})
    (out / "faults-history.jsonl").write_text("".join(json.dumps(e) + "\n" for e in entries))
    verdict = check(entries, config.seed, config.turns)
    results = {
        "config": asdict(config),
        "verdict": verdict.ok,
        "verdict_lines": verdict.lines(),
        "checker": {k: v for k, v in asdict(verdict).items() if k != "counts"},
        "counts": verdict.counts,
        "floors": verdict.floors,
        **figures(entries, config),
    }
    if png is not None:
        wait = f"--wait-replicas {config.wait_replicas}"
        timeline(entries, png, f"fault run, {wait}: writes and training under faults (shaded)")
    for log in workdir.glob("*.log"):  # the services' own logs, for a look afterwards
        shutil.copy(log, out / log.name)
    results["trail"] = trail(entries, flagged(verdict), out)
    shutil.rmtree(workdir, ignore_errors=True)
    return results


def drain(env, history, config, logs: list[Path], fill_prefix: str) -> None:
    """Wait until every published sample is trained by the consumers and by the trainer (or
    give up: the checker then names what was not). The real trainer trains whole batches
    (``FeedPlans``): when fewer than a batch are left and it has been idle a while, the run
    writes as many more samples (``-fill-``, checked like the rest) as complete the batch, and
    no more until it has stepped again."""
    batch = fault_megatron.BATCH if config.trainer == "megatron" else 1
    fill_ids = sample_ids(env, fill_prefix, None)
    deadline = time.monotonic() + (240 if batch > 1 else 60)
    last_step, filled = time.monotonic(), False
    with RouteCacheClient(env.target, timeout_s=OP_TIMEOUT_S, retry=RETRY) as client:
        while time.monotonic() < deadline:
            published = {
                e["sample"]
                for e in history.entries
                if e["op"] == "append" and e["ok"] and e["final"]
            }
            done = load_history(logs)
            trained = {e["sample"] for e in done if e["op"] == "train"}
            stepped = {s for e in done if e["op"] in ("step", "dead_letter") for s in e["samples"]}
            if published <= trained and published <= stepped:
                return
            if any(e["op"] == "step" and e["t"] > history.now() - 5 for e in done):
                last_step, filled = time.monotonic(), False
            left = len(published - stepped) % batch
            if left and not filled and time.monotonic() - last_step > 5:
                for _ in range(batch - left):
                    sample = next(fill_ids)
                    run_sample(client, env, history, config, sample, "any", time.monotonic())
                filled = True
            time.sleep(0.5)


def report(results: dict) -> str:
    """The verdict and the figures, as printed and as the docs section."""
    f = results
    out = list(f["verdict_lines"])
    out.append(
        f"write availability: {f['succeeded']} of {f['operations']} operations "
        f"({100 * (f['availability'] or 0):.2f}%); failed by status: "
        f"{f['failed_by_status'] or 'none'}"
    )
    gaps = ", ".join(
        f"shard {k}: {v[0]:.2f} s (from {v[1]:.1f} s)"
        for k, v in f["write_gap_per_shard_s"].items()
    )
    out.append(f"longest write gap per shard: {gaps}")
    o = f["latency_outside_faults"]
    out.append(
        f"latency outside faults: p50 {o['p50_ms']} ms, p99 {o['p99_ms']} ms ({o['count']} ops)"
    )
    out.append(
        f"{'fault':18} {'on':>6} {'start s':>7} {'healed s':>8} {'ops':>4} {'failed':>6} "
        f"{'p50 ms':>7} {'p99 ms':>8} {'recovery s':>10} {'after heal':>10} {'gap s':>5}"
    )
    for x in f["faults"]:
        gap = "-" if x["write_gap_s"] is None else f"{x['write_gap_s']:.2f}"
        out.append(
            f"{x['fault']:18} {x['component']:>6} {x['start_s']:7.1f} {x['healed_s']:8.1f} "
            f"{x['ops']:4} {x['failed']:6} {x['p50_ms'] or '-':>7} {x['p99_ms'] or '-':>8} "
            f"{x['recovery_s']:10.2f} {x['after_heal_s']:10.2f} {gap:>5}  {x['detail']}"
        )
    out.append(
        f"recovery target: {f['recovery_target_s']} s; publish -> trained: "
        f"p50 {f['publish_to_train_s']['p50']} s, max {f['publish_to_train_s']['max']} s"
    )
    return "\n".join(out + f.get("trail", []))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--short", action="store_true", help="the test suite's ~30 s schedule")
    parser.add_argument("--soak", action="store_true", help="a seeded random schedule")
    parser.add_argument("--duration", type=float, default=None, help="seconds of writes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--wait-replicas", type=int, default=1)
    parser.add_argument(
        "--drop-ack",
        action="store_true",
        help="consumer c1 skips one acknowledgement: the checker must fail",
    )
    parser.add_argument(
        "--mutate", choices=MUTATIONS, default="", help="remove a guarantee: the run must fail"
    )
    parser.add_argument(
        "--trainer",
        choices=TRAINERS,
        default="stand-in",
        help="the trainer's feed path with a stand-in step, or python -m trainer (megatron)",
    )
    parser.add_argument("--quick", action="store_true", help="run_all's smoke run: --short")
    args = parser.parse_args(argv)
    if args.trainer == "megatron" and args.mutate in ("trainer-early-ack", "no-dead-letter"):
        parser.error(f"--mutate {args.mutate} mutates the stand-in trainer: not with megatron")
    short = args.short or args.quick
    config = FaultConfig(
        duration_s=args.duration or (24.0 if short else 600.0 if args.soak else 90.0),
        short=short,
        wait_replicas=args.wait_replicas,
        drop_ack=args.drop_ack,
        mutate=args.mutate,
        seed=args.seed,
        schedule="soak" if args.soak else "",
        trainer=args.trainer,
        sample_rate=MEGATRON_SAMPLE_RATE if args.trainer == "megatron" else FaultConfig.sample_rate,
        max_ops=30_000 if args.soak else FaultConfig.max_ops,  # 8000 ends a soak's writes early
    )
    from benchmarks.common import RESULTS, machine, write_section

    name = (
        ("faults_soak" if args.soak else "faults")
        + ("_no_wait" if not args.wait_replicas else "")
        + ("_drop_ack" if args.drop_ack else "")
        + (f"_{args.mutate.replace('-', '_')}" if args.mutate else "")
        + ("_megatron" if args.trainer == "megatron" else "")
    )
    png = None
    if not short and name in ("faults", "faults_soak"):
        png = ROOT / "docs" / f"reliability-{name.replace('_', '-')}.png"
    results = run(config, RESULTS / name, png or RESULTS / f"{name}.png")
    text = report(results)
    print(text)
    print(
        f"history: {RESULTS / name / 'faults-history.jsonl'} (check it again: "
        f"python -m benchmarks.faults.fault_check {RESULTS / name / 'faults-history.jsonl'})"
    )
    results["machine"] = machine()
    command = (
        "python -m benchmarks.faults.bench_faults"
        + " --short" * short
        + " --soak" * args.soak
        + (f" --seed {args.seed}" if args.seed else "")
        + (f" --wait-replicas {args.wait_replicas}" if args.wait_replicas != 1 else "")
        + (" --drop-ack" * args.drop_ack)
        + (f" --mutate {args.mutate}" if args.mutate else "")
        + (f" --trainer {args.trainer}" if args.trainer != "stand-in" else "")
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
