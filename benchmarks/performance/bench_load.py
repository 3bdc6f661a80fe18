"""Load test of the route cache: N concurrent writers and M concurrent batch readers against a
route cache PROCESS (``python -m route_cache`` on loopback) for a fixed duration.

Writers store synthetic records (Qwen3-30B-A3B geometry by default) one by one through the
blocking client; readers fetch random batches of already acknowledged records with ReadBatch
and compare each with what was sent. At the end every acknowledged record is read back and
compared whole: a record missing or different counts as lost (it must be zero).

Reports records written and read, errors by status code, p50/p99 latency per operation and
records lost. ``tests/route_cache/test_load.py`` runs the same driver small in CI.

Usage: python -m benchmarks.performance.bench_load [--writers 8] [--readers 4] [--duration 60]
       [--tokens 4096] [--batch 8] [--max-writes 100] [--redis-url URL] [--quick]
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from routereplay.dev.launch import start_service, stop_process
from routereplay.dev.synthetic import QWEN3_30B_A3B, synthetic_record
from routereplay.domain.record import Geometry, Record
from routereplay.errors import RouteReplayError
from routereplay.rpc.client import RouteCacheClient

MIB = 2**20


@dataclass
class LoadConfig:
    """writers, readers: concurrent threads, each with its own channel; duration_s: how long
    they run; tokens: per record; batch: ids per ReadBatch; max_writes: per writer (a bound
    on the count besides the time); pool: distinct route arrays generated up front."""

    writers: int = 8
    readers: int = 4
    duration_s: float = 60.0
    tokens: int = 4096
    batch: int = 8
    max_writes: int = 100_000
    pool: int = 8
    seed: int = 0
    geometry: Geometry = field(default=QWEN3_30B_A3B)


class _Stats:
    def __init__(self):
        self.lock = threading.Lock()
        self.acked: dict[str, int] = {}  # sample id -> pool index of what was sent
        self.acked_ids: list[str] = []
        self.latency: dict[str, list[float]] = {"write": [], "read_batch": []}
        self.errors: Counter[str] = Counter()
        self.records_read = 0
        self.corrupt_reads = 0
        self.bytes_written = 0
        self.bytes_read = 0


def _same(got: Record, sent: Record) -> bool:
    return (
        got.sample_id == sent.sample_id
        and got.group_id == sent.group_id
        and got.geometry == sent.geometry
        and np.array_equal(got.token_ids, sent.token_ids)
        and np.array_equal(got.routes, sent.routes)
        and len(got.turns) == len(sent.turns)
        and all(
            (a.token_start, a.token_end, a.generated_start, a.policy_version)
            == (b.token_start, b.token_end, b.generated_start, b.policy_version)
            and np.array_equal(a.logprobs, b.logprobs)
            for a, b in zip(got.turns, sent.turns, strict=True)
        )
    )


def run_load(target: str, config: LoadConfig) -> dict:
    """Drive the route cache at ``target`` with ``config``; returns the figures (a dict)."""
    rng = np.random.default_rng(config.seed)
    prefix = f"load-{uuid.uuid4().hex[:8]}"
    pool = [
        synthetic_record("x", config.geometry, config.tokens, rng, skew=1.0, group_id=f"{prefix}-g")
        for _ in range(config.pool)
    ]
    record_bytes = pool[0].routes.nbytes + pool[0].token_ids.nbytes
    stats = _Stats()
    start = time.monotonic()
    deadline = start + config.duration_s

    def sent(sample_id: str) -> Record:
        return replace(pool[stats.acked[sample_id]], sample_id=sample_id)

    writers_done: list[float] = []

    def writer(w: int):
        try:
            _writer(w)
        finally:
            with stats.lock:
                writers_done.append(time.monotonic() - start)

    def _writer(w: int):
        with RouteCacheClient(target, timeout_s=60) as client:
            for i in range(config.max_writes):
                if time.monotonic() >= deadline:
                    return
                sample_id, index = f"{prefix}-w{w}-{i}", (w + i) % config.pool
                t0 = time.perf_counter()
                try:
                    client.write(replace(pool[index], sample_id=sample_id))
                except RouteReplayError as exc:
                    with stats.lock:
                        stats.errors[f"write {exc.status}"] += 1
                    continue
                elapsed = time.perf_counter() - t0
                with stats.lock:
                    stats.latency["write"].append(elapsed)
                    stats.acked[sample_id] = index
                    stats.acked_ids.append(sample_id)
                    stats.bytes_written += record_bytes

    def reader(r: int):
        pick = random.Random(config.seed * 1000 + r)
        with RouteCacheClient(target, timeout_s=60) as client:
            while time.monotonic() < deadline:
                with stats.lock:
                    known = list(stats.acked_ids)
                if not known:
                    time.sleep(0.01)
                    continue
                ids = [known[pick.randrange(len(known))] for _ in range(config.batch)]
                t0 = time.perf_counter()
                try:
                    got = list(client.read_batch(ids))
                except RouteReplayError as exc:
                    with stats.lock:
                        stats.errors[f"read_batch {exc.status}"] += 1
                    continue
                elapsed = time.perf_counter() - t0
                bad = sum(not _same(g, sent(s)) for g, s in zip(got, ids, strict=True))
                with stats.lock:
                    stats.latency["read_batch"].append(elapsed)
                    stats.records_read += len(got)
                    stats.corrupt_reads += bad + (len(ids) - len(got))
                    stats.bytes_read += record_bytes * len(got)

    def guarded(fn, i: int):
        try:
            fn(i)
        except Exception as exc:  # noqa: BLE001 - reported, never swallowed
            with stats.lock:
                stats.errors[f"{fn.__name__} crashed: {type(exc).__name__}: {exc}"] += 1

    threads = [threading.Thread(target=guarded, args=(writer, w)) for w in range(config.writers)]
    threads += [threading.Thread(target=guarded, args=(reader, r)) for r in range(config.readers)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    elapsed = time.monotonic() - start
    # Writers stop at the deadline or at max_writes, whichever comes first.
    writing_s = max(writers_done, default=elapsed)

    # Every acknowledged write must read back whole and equal to what was sent.
    lost = 0
    verify_start = time.monotonic()
    with RouteCacheClient(target, timeout_s=120) as client:
        ids = list(stats.acked_ids)
        for i in range(0, len(ids), 64):
            window = ids[i : i + 64]
            got = {
                r.sample_id: r
                for r in client.read_batch(window, skip_missing=True)
                if isinstance(r, Record)
            }
            lost += sum(s not in got or not _same(got[s], sent(s)) for s in window)
        for sample_id in ids:  # leave the store as it was
            client.delete(sample_id)
    verify_s = time.monotonic() - verify_start

    def percentiles(values: list[float]) -> dict:
        if not values:
            return {"count": 0, "p50_ms": None, "p99_ms": None}
        ms = np.asarray(values) * 1000
        return {
            "count": len(values),
            "p50_ms": round(float(np.percentile(ms, 50)), 2),
            "p99_ms": round(float(np.percentile(ms, 99)), 2),
            "max_ms": round(float(ms.max()), 2),
        }

    config_dict = asdict(config)
    config_dict["geometry"] = config.geometry.model_id or str(config.geometry)
    return {
        "config": config_dict,
        "record_mib": round(record_bytes / MIB, 3),
        "duration_s": round(elapsed, 2),
        "records_written": len(stats.acked_ids),
        "records_read": stats.records_read,
        "writing_s": round(writing_s, 2),
        "write_mib_s": round(stats.bytes_written / MIB / writing_s, 1),
        "read_mib_s": round(stats.bytes_read / MIB / elapsed, 1),
        "errors": dict(stats.errors),
        "corrupt_reads": stats.corrupt_reads,
        "records_lost": lost,
        "verify_s": round(verify_s, 2),
        "latency": {op: percentiles(v) for op, v in stats.latency.items()},
    }


def start_cache(redis_url: str, port: int | None = None) -> tuple[subprocess.Popen, str]:
    """A route cache process on a free loopback port over ``redis_url``: (process, target)."""
    env = {**os.environ, "ROUTE_CACHE_REDIS_URL": redis_url, "ROUTE_CACHE_GRACE_S": "5"}
    return start_service("route_cache", port=port, env=env, quiet=True, timeout_s=30)


def markdown(results: dict, machine_line: str) -> str:
    c, lat = results["config"], results["latency"]
    errors = ", ".join(f"{k}: {v}" for k, v in results["errors"].items()) or "none"
    w, r = lat["write"], lat["read_batch"]
    totals = " | ".join(
        str(v)
        for v in (
            results["records_written"],
            results["records_read"],
            results["write_mib_s"],
            results["read_mib_s"],
            errors,
            results["corrupt_reads"],
            f"**{results['records_lost']}**",
        )
    )
    return f"""## Load: concurrent writers and batch readers

{c["writers"]} writers and {c["readers"]} batch readers (ReadBatch of {c["batch"]}) against one
route cache process on loopback for {results["duration_s"]} s; records of {c["tokens"]} tokens of
{c["geometry"]} ({results["record_mib"]} MiB of routes and tokens each). Every acknowledged
record was then read back whole and compared with what was sent. Writers stopped after
{results["writing_s"]} s (the deadline, or {c["max_writes"]} records each, which bounds Redis
memory); write MiB/s is over that time, read MiB/s over the whole run.

| written | read | write MiB/s | read MiB/s | errors | corrupt reads | lost |
|---:|---:|---:|---:|---|---:|---:|
| {totals} |

| operation | count | p50 ms | p99 ms | max ms |
|---|---:|---:|---:|---:|
| write (1 record) | {w["count"]} | {w["p50_ms"]} | {w["p99_ms"]} | {w.get("max_ms")} |
| ReadBatch ({c["batch"]} records) | {r["count"]} | {r["p50_ms"]} | {r["p99_ms"]} | \
{r.get("max_ms")} |

Machine: {machine_line}. Reproduce: `python -m benchmarks.performance.bench_load --writers
{c["writers"]} \
--readers {c["readers"]} --duration {c["duration_s"]:g} --tokens {c["tokens"]} \
--max-writes {c["max_writes"]}`.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--writers", type=int, default=8)
    parser.add_argument("--readers", type=int, default=4)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument(
        "--max-writes", type=int, default=100, help="per writer: bounds Redis memory"
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2+2 threads, 5 s")
    parser.add_argument("--redis-url", default="", help="empty: start an embedded server")
    args = parser.parse_args(argv)
    if args.quick:
        args.writers, args.readers, args.duration, args.tokens = 2, 2, 5.0, 1024

    from benchmarks.common import machine, write_section

    embedded = None
    url = args.redis_url
    if not url:
        from route_cache.embedded import start_embedded_redis

        embedded, url = start_embedded_redis()
    proc, target = start_cache(url)
    try:
        config = LoadConfig(
            args.writers, args.readers, args.duration, args.tokens, args.batch, args.max_writes
        )
        results = run_load(target, config)
        results["server_alive"] = proc.poll() is None
    finally:
        stop_process(proc, 10)
        if embedded is not None:
            embedded.stop()
    machine_line = machine()
    results["machine"] = machine_line
    text = markdown(results, machine_line)
    print(text)
    write_section("load", text, results)
    return 0 if results["records_lost"] == 0 and results["corrupt_reads"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
