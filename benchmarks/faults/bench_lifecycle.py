"""The long run: a route cache whose Redis holds a small fraction of the run's route bytes,
fed faster than the trainer consumes, through every phase of a real run's life.

On loopback, bounded in time:

- one ``redis-server`` with ``maxmemory`` (``noeviction``, as deployed), and the route cache as
  its own process (``python -m route_cache``) with ``--commit-groups trainer``,
  ``--memory-budget 0.9`` and a short ``--free-grace-s``;
- writers, each starting a record every ``1 / rate`` seconds: Qwen3-30B-A3B geometry (48 MoE
  layers x top-8 = 384 route bytes per token), ``tokens`` long. A write refused for memory
  (RESOURCE_EXHAUSTED) is held and retried after the time the route cache names, as the
  rollout server does; a record still refused ``hold_s`` after it was generated counts as
  dropped (the rollout server holds it forever; the bound lets a failing run end);
- the trainer's own feed path (``fault_trainer.py``: ``FeedPlans``, ``CacheSource``, a
  checkpoint every ``every`` steps, then ``FeedPlans.ack``; a stand-in step of ``step_s``), which
  consumes fewer samples per second than the writers send, so the budget must hold them back.

Phases: ``steady``; ``trainer_stopped`` (SIGSTOP, for longer than the budget lasts: the writers
back off); ``trainer_back`` (SIGCONT: the backlog drains); ``trainer_killed`` (SIGKILL right
after a checkpoint, before its acknowledgement, then started again from that checkpoint);
``cache_restart`` (the route cache SIGKILLed and started again); then the writers stop and the
trainer drains what is left.

Sampled every ``sample_s``: Redis ``used_memory``, the writes refused, the oldest unconsumed
sample's age. From the writers' and the trainer's logs afterwards: the route bytes in flight
(stored and not yet acknowledged plus the grace), and the checks:

- every stored sample trained exactly once in the steps the final weights descend from;
- 0 generated records dropped, 0 trained on other bytes than were written;
- 0 records freed before the trainer committed them (a fetch that found a record missing);
- Redis memory never above the budget plus one write per writer, and in steady state at most
  1.2 x the bytes in flight plus a fixed overhead;
- the run's route bytes at least ``traffic_x`` x ``maxmemory``.

``--no-free`` runs the route cache without ``--commit-groups``: Redis fills, writes are refused
past ``hold_s``, and the run must FAIL (shown in docs/benchmarks.md).

Usage: python -m benchmarks.faults.bench_lifecycle [--quick] [--no-free]
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import redis

from benchmarks.common import (
    ROOT,
    Run,
    interleaved,
    machine,
    paired_ratio,
    wait_until,
    write_section,
)
from benchmarks.faults.fault_history import History, digest, load_history, trainer_steps
from route_cache.feed import ReadyFeed
from route_cache.server import SWEEP_INTERVAL_S
from routereplay.dev.launch import free_port, start_service, stop_process
from routereplay.dev.redis_nodes import RedisProcess
from routereplay.dev.synthetic import QWEN3_30B_A3B, synthetic_routes
from routereplay.domain.record import Record, Turn
from routereplay.errors import ResourceExhausted, RouteReplayError
from routereplay.rpc.client import RouteCacheClient

MIB = 2**20
GROUP = "trainer"
POOL = 4  # distinct route arrays the records are cut from (drawing 32K x 48 x 8 ids per record
# would make the writers, not the route cache, the bottleneck)


@dataclass(frozen=True)
class LifecycleConfig:
    maxmemory_mb: int = 256
    tokens: tuple[int, int] = (4096, 32768)
    writers: int = 3
    rate: float = 2.0  # records per second per writer
    batch: int = 1  # samples per trainer step (a partial batch ends the trainer's feed)
    step_s: float = 0.2
    every: int = 4  # checkpoint every this many steps
    phases: tuple[tuple[str, float], ...] = (
        ("steady", 80),
        ("trainer_stopped", 30),
        ("trainer_back", 80),
        ("trainer_killed", 40),
        ("cache_restart", 40),
    )
    hold_s: float = 120.0
    free_grace_s: float = 1.0
    sample_s: float = 0.5
    traffic_x: float = 20.0
    free: bool = True
    seed: int = 0
    # Of maxmemory: what is left is Redis's own buffers, a record per connection moving one
    # (each writer's query buffer, the trainer's reply buffer; see ``headroom``).
    budget: float = 0.75

    @property
    def headroom(self) -> int:
        """Bytes Redis may hold beyond the records: a largest record per connection in flight
        (the writers' and the trainer's), which ``used_memory`` counts as client buffers."""
        return (self.writers + 1) * self.tokens[1] * QWEN3_30B_A3B.row_bytes


QUICK = LifecycleConfig(
    maxmemory_mb=32,
    tokens=(512, 2048),
    writers=2,
    rate=8.0,
    step_s=0.05,
    phases=(
        ("steady", 12),
        ("trainer_stopped", 6),
        ("trainer_back", 10),
        ("trainer_killed", 10),
        ("cache_restart", 10),
    ),
    hold_s=12.0,
    traffic_x=5.0,
    budget=0.8,
)


def make_record(seed: int, sample_id: str, config: LifecycleConfig, pool: list) -> Record:
    """What a writer sends for ``sample_id``: a pure function of it, so the checker rebuilds
    it instead of keeping it."""
    key = zlib.crc32(sample_id.encode())
    rng = np.random.default_rng([seed, key])
    tokens = int(rng.integers(config.tokens[0], config.tokens[1] + 1))
    turn = Turn(0, tokens, tokens // 4, 0, np.zeros(tokens - tokens // 4, np.float32))
    return Record(
        sample_id,
        QWEN3_30B_A3B,
        rng.integers(0, 32000, tokens, dtype=np.int32),
        pool[key % POOL][: tokens - 1],
        [turn],
    )


class LongRun:
    """The processes of one run and what the writers saw."""

    def __init__(self, config: LifecycleConfig, workdir: Path):
        self.config, self.workdir = config, workdir
        self.start = time.time()
        self.history = History(workdir / "run.jsonl", "run", self.start)
        self.redis = RedisProcess(
            "--maxmemory",
            f"{config.maxmemory_mb}mb",
            "--maxmemory-policy",
            "noeviction",
            "--save",
            "",
        ).start()
        self.r = redis.Redis(port=self.redis.port)
        self.baseline = int(self.r.info("memory")["used_memory"])
        self.cache_port = free_port()
        self.cache = None
        self.start_cache()
        self.target = f"127.0.0.1:{self.cache_port}"
        self.pause_dir, self.stop_file = workdir / "pause", workdir / "stop"
        self.pause_dir.mkdir()
        self.trainer: subprocess.Popen | None = None
        self.start_trainer()
        self.refused = 0
        self.lock = threading.Lock()

    def start_cache(self) -> None:
        args = [
            "--redis-url", self.redis.url, "--memory-budget", str(self.config.budget),
            "--free-grace-s", str(self.config.free_grace_s),
        ]  # fmt: skip
        if self.config.free:
            args += ["--commit-groups", GROUP]
        self.cache, _ = start_service(
            "route_cache", *args, port=self.cache_port, quiet=True, timeout_s=120
        )

    def start_trainer(self) -> None:
        c = self.config
        self.trainer = subprocess.Popen(
            [
                sys.executable, "-m", "benchmarks.faults.fault_trainer", "--target", self.target,
                "--group", GROUP, "--history", str(self.workdir / "trainer.jsonl"),
                "--checkpoint-dir", str(self.workdir / "checkpoints"),
                "--pause-dir", str(self.pause_dir), "--stop-file", str(self.stop_file),
                "--start", str(self.start), "--batch", str(c.batch), "--every", str(c.every),
                "--step-s", str(c.step_s), "--attempts", "40",
            ],
            stdout=subprocess.DEVNULL,
            cwd=ROOT,
        )  # fmt: skip

    def stop(self) -> None:
        for proc in (self.trainer, self.cache):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                stop_process(proc, 10)
        self.r.close()
        self.redis.stop()
        self.history.close()


def writer(run: LongRun, name: str, pool: list, deadline: float) -> None:
    """Starts a record every ``1 / rate`` s (a late one starts at once), holding refused ones."""
    config, n = run.config, 0
    with RouteCacheClient(run.target, timeout_s=30) as client:
        next_at = time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(max(0.0, next_at - time.monotonic()))
            next_at += 1 / config.rate
            sample_id = f"{name}-{n}"
            n += 1
            record = make_record(config.seed, sample_id, config, pool)
            generated = time.monotonic()
            while True:
                try:
                    client.write(record)
                    run.history.log(
                        "stored", sample=sample_id, bytes=record.routes.nbytes,
                        held_s=round(time.monotonic() - generated, 3),
                    )  # fmt: skip
                    break
                except ResourceExhausted as exc:
                    with run.lock:
                        run.refused += 1
                    if time.monotonic() - generated > config.hold_s:
                        run.history.log("dropped", sample=sample_id, status=exc.status)
                        break
                    time.sleep(exc.retry_after_s or 1.0)
                except RouteReplayError as exc:  # the route cache restarting
                    if time.monotonic() - generated > config.hold_s:
                        run.history.log("dropped", sample=sample_id, status=exc.status)
                        break
                    time.sleep(0.5)


def sampler(run: LongRun, stop: threading.Event) -> None:
    feed = ReadyFeed(run.r, "rr:ready")  # the route cache's default stream, read as it reads it
    while not stop.wait(run.config.sample_s):
        try:
            info = run.r.info("memory")
            oldest = _oldest_unconsumed_s(feed)
        except redis.RedisError:
            continue
        run.history.log(
            "sample",
            used=int(info["used_memory"]),
            dataset=int(info["used_memory_dataset"]),
            clients=int(info.get("mem_clients_normal", 0)),
            refused=run.refused,
            oldest_s=oldest,
        )


def _oldest_unconsumed_s(feed: ReadyFeed) -> float:
    """Age of the oldest entry the trainer's group has pending or not delivered (0: none)."""
    oldest = [b.oldest_ms for b in feed.backlog() if b.group == GROUP and b.oldest_ms]
    return max(0.0, time.time() - oldest[0] / 1000) if oldest else 0.0


def _trainer_log(run: LongRun) -> list[dict]:
    return load_history([run.workdir / "trainer.jsonl"])


def phase(run: LongRun, name: str, seconds: float) -> None:
    run.history.log("phase", name=name)
    end = time.monotonic() + seconds
    if name == "trainer_stopped":
        run.trainer.send_signal(signal.SIGSTOP)
        time.sleep(seconds)
        run.trainer.send_signal(signal.SIGCONT)
    elif name == "trainer_killed":
        lives = sum(e["op"] == "resume" for e in _trainer_log(run))
        (run.pause_dir / "after_checkpoint").touch()  # it stops itself there: killed there
        wait_until(
            lambda: any(e["op"] == "paused" for e in _trainer_log(run)[-5:]),
            120,
            "the trainer's pause",
        )
        run.trainer.kill()
        run.trainer.wait()
        run.start_trainer()
        wait_until(
            lambda: sum(e["op"] == "resume" for e in _trainer_log(run)) > lives,
            120,
            "the trainer's resume",
        )
    elif name == "cache_restart":
        time.sleep(seconds / 2)
        run.cache.kill()
        run.cache.wait()
        run.start_cache()
    time.sleep(max(0.0, end - time.monotonic()))


def execute(config: LifecycleConfig, workdir: Path, pool: list) -> tuple[list[dict], LongRun]:
    run = LongRun(config, workdir)
    try:
        stop = threading.Event()
        threading.Thread(target=sampler, args=(run, stop), daemon=True).start()
        deadline = time.monotonic() + sum(s for _, s in config.phases)
        writers = [
            threading.Thread(target=writer, args=(run, f"w{i}", pool, deadline))
            for i in range(config.writers)
        ]
        for thread in writers:
            thread.start()
        for name, seconds in config.phases:
            phase(run, name, seconds)
        for thread in writers:
            thread.join()
        run.history.log("phase", name="drain")
        stored = {e["sample"] for e in run.history.entries if e["op"] == "stored"}
        wait_until(lambda: stored <= _trained(_trainer_log(run)), 300, "the trainer's drain")
        run.stop_file.touch()
        run.trainer.wait(120)
        stop.set()
        run.history.log("end", used=int(run.r.info("memory")["used_memory"]))
        return run.history.entries + _trainer_log(run), run
    finally:
        run.stop()


def _trained(trainer_log: list[dict]) -> set[str]:
    return {s for e in trainer_log if e["op"] == "step" for s in e["samples"]}


def in_flight(entries: list[dict], grace_s: float) -> list[tuple[float, int]]:
    """(t, route bytes stored and not yet freed) at each memory sample: a record is in
    flight from its write to its acknowledgement plus the grace and the route cache's next
    sweep (``SWEEP_INTERVAL_S``)."""
    grace_s += SWEEP_INTERVAL_S
    stored = {e["sample"]: (e["t"], e["bytes"]) for e in entries if e["op"] == "stored"}
    freed = {}
    for e in entries:
        if e["op"] == "ack" and e.get("ok"):
            for s in e["samples"]:
                freed.setdefault(s, e["t"] + grace_s)
    events = sorted(
        [(t, b) for t, b in stored.values()]
        + [(freed[s], -b) for s, (_, b) in stored.items() if s in freed]
    )
    out, total, i = [], 0, 0
    for e in entries:
        if e["op"] != "sample":
            continue
        while i < len(events) and events[i][0] <= e["t"]:
            total += events[i][1]
            i += 1
        out.append((e["t"], total))
    return out


def check(entries: list[dict], config: LifecycleConfig, baseline: int, pool: list) -> dict:
    """The run's verdict and figures, from its entries alone (and what the writers send)."""
    stored = {e["sample"]: e for e in entries if e["op"] == "stored"}
    dropped = [e["sample"] for e in entries if e["op"] == "dropped"]
    steps = trainer_steps(entries) or {"committed": [], "discarded": [], "processes": 0}
    trained: dict[str, int] = {}
    corrupt = []
    for step in steps["committed"]:
        for sample, got in zip(step["samples"], step["digests"], strict=True):
            trained[sample] = trained.get(sample, 0) + 1
            if got != digest(make_record(config.seed, sample, config, pool)):
                corrupt.append(sample)
    freed_early = [
        e for e in entries if e["op"] == "fetch" and not e.get("ok") and e["status"] == "NOT_FOUND"
    ]
    samples = [e for e in entries if e["op"] == "sample"]
    maxmemory = config.maxmemory_mb * MIB
    ceiling = config.budget * maxmemory + config.headroom
    flight = dict(in_flight(entries, config.free_grace_s))
    phases = [(e["t"], e["name"]) for e in entries if e["op"] == "phase"]

    def phase_at(t: float) -> str:
        return ([name for start, name in phases if start <= t] or ["start"])[-1]

    overhead = baseline + config.headroom
    steady_phases = ("steady", "trainer_back")
    steady = [(s["used"], flight[s["t"]]) for s in samples if phase_at(s["t"]) in steady_phases]
    over = [(u, f) for u, f in steady if u > 1.2 * f + overhead]
    total = sum(e["bytes"] for e in stored.values())
    verdict = {
        "stored": len(stored),
        "lost": sorted(s for s in stored if s not in trained),
        "trained_twice": sorted(s for s, n in trained.items() if n > 1),
        "dropped": dropped,
        "corrupt": corrupt,
        "freed_before_commit": len(freed_early),
        "memory_over_ceiling": sum(s["used"] > ceiling for s in samples),
        "redis_full": sum(s["used"] >= 0.99 * maxmemory for s in samples),
        "steady_over_1_2x_in_flight": len(over),
        "traffic_x": round(total / maxmemory, 1),
    }
    verdict["pass"] = (
        not verdict["lost"] and not verdict["trained_twice"] and not dropped and not corrupt
        and not freed_early and not verdict["memory_over_ceiling"] and not over
        and not verdict["redis_full"]
        and total >= config.traffic_x * maxmemory
    )  # fmt: skip
    figures = {
        "max_used_mib": round(max((s["used"] for s in samples), default=0) / MIB, 1),
        "ceiling_mib": round(ceiling / MIB, 1),
        "refused": max((s["refused"] for s in samples), default=0),
        "max_oldest_s": max((s["oldest_s"] or 0 for s in samples), default=0),
        "route_gib": round(total / 2**30, 2),
        "trainer_processes": steps["processes"],
        "discarded_steps": len(steps["discarded"]),
        "max_held_s": max((e["held_s"] for e in stored.values()), default=0),
        "steady_used_over_in_flight": round(
            float(np.median([(u - baseline) / max(f, 1) for u, f in steady])) if steady else 0, 2
        ),
    }
    return {"verdict": verdict, "figures": figures}


def plot(entries: list[dict], config: LifecycleConfig, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = [e for e in entries if e["op"] == "sample"]
    flight = in_flight(entries, config.free_grace_s)
    t = [s["t"] for s in samples]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    top.plot(t, [s["used"] / MIB for s in samples], label="Redis used_memory")
    top.plot([x for x, _ in flight], [b / MIB for _, b in flight], label="route bytes in flight")
    budget = config.budget * config.maxmemory_mb
    top.axhline(budget, color="red", ls="--", label=f"budget ({config.budget:g} of maxmemory)")
    top.axhline(config.maxmemory_mb, color="black", ls=":", label="maxmemory")
    top.set_ylabel("MiB")
    top.legend(loc="upper left", fontsize=8)
    bottom.plot(t, [s["refused"] for s in samples], label="writes refused (cumulative)")
    twin = bottom.twinx()
    twin.plot(t, [s["oldest_s"] or 0 for s in samples], color="green", label="oldest unconsumed")
    twin.set_ylabel("oldest unconsumed sample, s")
    bottom.set_ylabel("writes refused")
    bottom.set_xlabel("seconds")
    for e in entries:
        if e["op"] == "phase":
            for ax in (top, bottom):
                ax.axvline(e["t"], color="grey", lw=0.5)
            top.text(e["t"], config.maxmemory_mb * 1.02, e["name"], fontsize=7, rotation=20)
    bottom.legend(loc="upper left", fontsize=8)
    twin.legend(loc="upper right", fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run(config: LifecycleConfig) -> dict:
    if config.budget * config.maxmemory_mb * MIB + config.headroom >= config.maxmemory_mb * MIB:
        raise ValueError("the budget leaves Redis no headroom for its buffers: lower --budget")
    rng = np.random.default_rng(config.seed)
    pool = [synthetic_routes(QWEN3_30B_A3B, config.tokens[1], rng) for _ in range(POOL)]
    with tempfile.TemporaryDirectory(prefix="rr-lifecycle-") as tmp:
        started = time.monotonic()
        entries, ran = execute(config, Path(tmp), pool)
        result = check(entries, config, ran.baseline, pool)
        result["wall_s"] = round(time.monotonic() - started, 1)
        result["config"] = asdict(config)
        result["entries"] = entries
    return result


def report(result: dict) -> str:
    v, f, c = result["verdict"], result["figures"], result["config"]
    mode = "freeing on" if c["free"] else "freeing OFF (--no-free)"
    lines = [
        f"{'PASS' if v['pass'] else 'FAIL'} ({mode}): {v['stored']} records stored, "
        f"{f['route_gib']} GiB of routes = {v['traffic_x']}x maxmemory ({c['maxmemory_mb']} MiB), "
        f"in {result['wall_s']} s",
        f"lost {len(v['lost'])}, trained twice {len(v['trained_twice'])}, dropped "
        f"{len(v['dropped'])}, corrupt {len(v['corrupt'])}, freed before commit "
        f"{v['freed_before_commit']}",
        f"Redis used_memory max {f['max_used_mib']} MiB (budget {c['budget']} of maxmemory + "
        f"headroom = {f['ceiling_mib']} MiB; samples over it: {v['memory_over_ceiling']}, at "
        f"maxmemory: {v['redis_full']}); steady state median (used - baseline) / in flight "
        f"{f['steady_used_over_in_flight']}, samples over 1.2x in flight + headroom: "
        f"{v['steady_over_1_2x_in_flight']}",
        f"writes refused and retried {f['refused']}, longest a record was held "
        f"{f['max_held_s']} s, oldest unconsumed sample {f['max_oldest_s']:.1f} s; trainer "
        f"processes {f['trainer_processes']}, steps discarded by the kill {f['discarded_steps']}",
    ]
    return "\n".join(lines)


def cost_section(found: dict) -> str:
    return (
        "## The lifecycle's cost to writes\n\n"
        "`python -m benchmarks.faults.bench_lifecycle --cost`: batches of "
        f"{found['records_per_batch']} Qwen3-30B-A3B records of {found['tokens']} tokens "
        "written through a route cache that frees (`--commit-groups trainer`, the memory "
        "budget read every 0.25 s and checked on each write) and through one that does not, "
        "on the same Redis, taking turns batch by batch; between batches, untimed, the "
        "trainer's group acknowledges the last batch (freeing it; the other's is deleted). "
        f"Median of {found['repeats']} rounds of paired ratios (target: at least 0.95).\n\n"
        f"{machine()}\n\n| route cache | MiB/s | ratio |\n|---|---:|---:|\n"
        f"| freeing | {found['freeing_mib_s']} | {found['ratio']} |\n"
        f"| not freeing | {found['plain_mib_s']} | 1 |\n"
    )


def section(result: dict, text: str, png: str) -> str:
    """The run's section of docs/benchmarks.md."""
    c = result["config"]
    phases = ", ".join(f"{name} {seconds:g} s" for name, seconds in c["phases"])
    if c["free"]:
        head = (
            "## The long run: memory bounded by the work in flight\n\n"
            "`python -m benchmarks.faults.bench_lifecycle` (`make bench`; a small run in the test "
            "suite, `tests/route_cache/test_lifecycle_run.py`). "
        )
    else:
        head = (
            "## The long run without freeing (`--no-free`): it must fail\n\n"
            "The same run with the route cache freeing nothing (no `--commit-groups`, the "
            "behaviour before the lifecycle). "
        )
    return (
        f"{head}A `redis-server` with `maxmemory` {c['maxmemory_mb']} MiB (`noeviction`), the "
        f"route cache as its own process (`--memory-budget {c['budget']}`, "
        f"`--free-grace-s {c['free_grace_s']:g}`), {c['writers']} writers each starting a "
        f"Qwen3-30B-A3B record of {c['tokens'][0]}-{c['tokens'][1]} tokens every "
        f"{1 / c['rate']:g} s and holding a refused one as the rollout server does (dropped "
        f"after {c['hold_s']:g} s), and the trainer's own feed path (`fault_trainer.py`: "
        f"`FeedPlans`, `CacheSource`, a checkpoint every {c['every']} steps, then the "
        f"acknowledgement; a stand-in step of {c['step_s']:g} s), slower than the writers. "
        f"Phases: {phases}; then the trainer drains. Memory sampled every {c['sample_s']:g} s; "
        "the route bytes in flight are those stored and not yet acknowledged (plus the grace "
        "and the next sweep), from the writers' and the trainer's logs. Headroom: a largest "
        "record per connection in flight, which Redis counts as client buffers.\n\n"
        f"{machine()}\n\n```\n{text}\n```\n\n"
        f"![Redis memory, route bytes in flight and writes refused, per phase]({png})"
    )


def cost(repeats: int, records: int = 16, tokens: int = 4096) -> dict:
    """Write throughput through a route cache that frees (``--commit-groups``, the memory
    budget read and checked) against one that does not, on the same Redis, taking turns
    batch by batch. Each batch is then acknowledged by the trainer's group, untimed (that frees
    the first one's records; the second's are deleted), so Redis holds the same either way."""
    rng = np.random.default_rng(0)
    routes = synthetic_routes(QWEN3_30B_A3B, tokens, rng)
    node = RedisProcess("--maxmemory", "2gb", "--maxmemory-policy", "noeviction").start()
    flags = {
        "freeing": ["--commit-groups", GROUP, "--memory-budget", "0.9", "--free-grace-s", "0"],
        "plain": ["--memory-budget", "0"],
    }
    caches = {
        name: start_service(
            "route_cache", "--redis-url", node.url, "--ready-stream", f"rr:ready:{name}",
            *args, quiet=True, timeout_s=120,
        )
        for name, args in flags.items()
    }  # fmt: skip
    clients = {name: RouteCacheClient(target, timeout_s=60) for name, (_, target) in caches.items()}
    batch = {name: 0 for name in caches}

    def write(name: str):
        def fn():
            for i in range(records):
                sample_id = f"{name}-{batch[name]}-{i}"
                token_ids = rng.integers(0, 32000, tokens, dtype=np.int32)
                turn = Turn(0, tokens, tokens // 4, 0, np.zeros(tokens - tokens // 4, np.float32))
                record = Record(sample_id, QWEN3_30B_A3B, token_ids, routes[: tokens - 1], [turn])
                clients[name].write(record)

        return fn

    def commit(name: str):
        def setup():  # the previous batch acknowledged (and, without freeing, deleted)
            page = clients[name].read_ready(GROUP, "t", max_entries=records)
            if page.entries:
                clients[name].ack_ready(GROUP, [e.entry_id for e in page.entries], "t")
                if name == "plain":
                    for entry in page.entries:
                        clients[name].delete(entry.sample_id)
            batch[name] += 1

        return setup

    try:
        timings = interleaved(
            {
                name: Run(write(name), {"route cache": proc.pid}, commit(name))
                for name, (proc, _) in caches.items()
            },
            repeats,
        )
    finally:
        for client in clients.values():
            client.close()
        for proc, _ in caches.values():
            stop_process(proc, 10)
        node.stop()
    mib = records * (tokens - 1) * QWEN3_30B_A3B.row_bytes / MIB
    return {
        "records_per_batch": records,
        "tokens": tokens,
        "repeats": repeats,
        "freeing_mib_s": round(mib / timings["freeing"].median, 1),
        "plain_mib_s": round(mib / timings["plain"].median, 1),
        "ratio": round(paired_ratio(timings["freeing"], timings["plain"]), 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the test suite's small run")
    parser.add_argument("--no-free", action="store_true", help="the route cache frees nothing")
    parser.add_argument("--out", type=Path, default=None, help="the run's JSON (history too)")
    parser.add_argument(
        "--cost", action="store_true", help="only: write throughput with freeing against without"
    )
    args = parser.parse_args(argv)
    if args.cost:
        found = cost(repeats=5 if args.quick else 20)
        print(json.dumps(found))
        if not args.quick:
            write_section("lifecycle_cost", cost_section(found), found)
        return 0 if found["ratio"] >= 0.95 else 1
    config = QUICK if args.quick else LifecycleConfig()
    if args.no_free:  # steady state only: it fails there (a trainer with nothing new to train
        # never reaches the checkpoint the kill phase waits for)
        config = replace(config, free=False, phases=config.phases[:1])
    result = run(config)
    text = report(result)
    print(text)
    if args.out:
        args.out.write_text(json.dumps(result))
    if not args.quick:
        name = "lifecycle_no_free" if args.no_free else "lifecycle"
        png = ROOT / "docs" / f"benchmarks-{name.replace('_', '-')}.png"
        plot(result["entries"], config, png, text.splitlines()[0])
        summary = {k: v for k, v in result.items() if k != "entries"}
        write_section(name, section(result, text, png.name), summary)
    return 0 if result["verdict"]["pass"] != args.no_free else 1


if __name__ == "__main__":
    sys.exit(main())
