"""The route cache's cost per call, one call at a time, against the gRPC + Redis floor.

Throughput benchmarks (``bench_route_cache``) tell how fast bytes move with several calls in
flight; this one tells what each call costs, and on which side. For a record of a few tokens
(almost no bytes: what a call costs by itself) and one of 4K tokens (Qwen3-30B-A3B, 1.5 MiB),
in the same run:

- floor: the bytes through the bare gRPC service that keeps them in Redis
  (``benchmarks/performance/raw_grpc.py``: one SET per record on write, one GET on read, the same 1
  MiB
  chunks, the same server plumbing and channel options);
- route cache: ``RouteCacheClient.write`` of a new record (validated, checksummed, committed
  and announced), and ``read_batch`` of that one record (checksums verified, decoded).

Each is timed as ``--calls`` calls in a row, one after the other; the table gives the median
wall time per call and each process's CPU per call (client, server, Redis), in ms. The ratio
column is the route cache's wall time over the floor's: what the route cache adds per call.

Usage: python -m benchmarks.performance.bench_route_cache_calls [--quick] [--section NAME]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import uuid
from dataclasses import replace

import numpy as np
import redis

from benchmarks.common import machine, timed_with_cpu, write_section
from benchmarks.performance.bench_route_cache import ROLES, embedded_pid
from benchmarks.performance.raw_grpc import RawClient
from route_cache.embedded import start_embedded_redis
from route_cache.record_format import record_key, routes_key
from routereplay.allocator import keep_large_buffers
from routereplay.dev.launch import start_service, stop_process
from routereplay.dev.synthetic import QWEN3_30B_A3B, synthetic_record
from routereplay.rpc.chunks import DEFAULT_CHUNK_BYTES
from routereplay.rpc.client import RouteCacheClient

SIZES = {"a few tokens": 16, "4K tokens": 4096}


def bench_size(args, label, tokens, cache, floor, raw_redis, pids) -> dict:
    record = synthetic_record("x", QWEN3_30B_A3B, tokens, np.random.default_rng(0))
    payload = record.routes.tobytes()
    chunks = [
        payload[i : i + DEFAULT_CHUNK_BYTES] for i in range(0, len(payload), DEFAULT_CHUNK_BYTES)
    ]
    prefix = uuid.uuid4().hex[:8]
    counter = itertools.count()
    written: list[str] = []
    result = {"size": label, "tokens": tokens, "route_bytes": len(payload)}

    def measure(name: str, server: str, call, setup=None) -> None:
        roles = dict(zip(ROLES, (pids["client"], pids[server], pids["redis"]), strict=True))

        def calls():
            for _ in range(args.calls):
                call()

        seconds, cpu = timed_with_cpu(calls, args.repeats, roles, setup)
        result[name] = {"wall": seconds * 1e3 / args.calls} | {
            role: None if v is None else v * 1e3 / args.calls for role, v in cpu.items()
        }

    measure("floor_write", "floor", lambda: floor.write("calls", chunks))
    measure("floor_read", "floor", lambda: sum(len(c) for c in floor.read_batch(["calls"])))

    def forget_written():
        # Redis reuses the memory of deleted records (as a fleet at steady state does); the
        # floor overwrites its key.
        if written:
            raw_redis.delete(*(k for i in written for k in (record_key(i), routes_key(i))))
            written.clear()

    def write():
        sample_id = f"calls-{prefix}-{next(counter)}"
        cache.write(replace(record, sample_id=sample_id))
        written.append(sample_id)

    measure("service_write", "service", write, forget_written)
    last = written[-1]
    measure("service_read", "service", lambda: next(iter(cache.read_batch([last]))))
    forget_written()
    for op in ("write", "read"):
        result[f"{op}_ratio"] = result[f"service_{op}"]["wall"] / result[f"floor_{op}"]["wall"]
    return result


def _cell(figures: dict) -> str:
    cpu = " / ".join("-" if figures[r] is None else f"{figures[r]:.2f}" for r in ROLES)
    return f"{figures['wall']:.2f} | {cpu}"


def table(results: list[dict]) -> str:
    lines = [
        "| record | call | floor: wall | floor: CPU client / server / Redis "
        "| route cache: wall | route cache: CPU client / server / Redis "
        "| **route cache / floor, wall** |",
        "|---" * 7 + "|",
    ]
    for r in results:
        for op in ("write", "read"):
            lines.append(
                f"| {r['size']} ({r['route_bytes'] / 1024:.0f} KiB) | {op} "
                f"| {_cell(r[f'floor_{op}'])} | {_cell(r[f'service_{op}'])} "
                f"| **{r[f'{op}_ratio']:.2f}** |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed runs of --calls calls")
    parser.add_argument("--calls", type=int, default=40, help="calls per timed run")
    parser.add_argument("--quick", action="store_true", help="3 repeats of 10 calls")
    parser.add_argument("--section", default="route_cache_calls")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.calls = 3, 10
    keep_large_buffers()
    embedded, url = start_embedded_redis()
    service = floor_service = None
    results = []
    try:
        service, target = start_service("route_cache", "--redis-url", url, quiet=True)
        floor_service, floor_target = start_service(
            "benchmarks.performance.raw_grpc", "--redis-url", url, quiet=True
        )
        pids = {
            "client": os.getpid(),
            "service": service.pid,
            "floor": floor_service.pid,
            "redis": embedded_pid(embedded),
        }
        raw_redis = redis.Redis.from_url(url)
        floor = RawClient(floor_target)
        with RouteCacheClient(target, timeout_s=60) as cache:
            for label, tokens in SIZES.items():
                r = bench_size(args, label, tokens, cache, floor, raw_redis, pids)
                results.append(r)
                print(
                    f"{label}: route cache / floor per call, write {r['write_ratio']:.2f} "
                    f"({r['service_write']['wall']:.2f} ms), read {r['read_ratio']:.2f} "
                    f"({r['service_read']['wall']:.2f} ms)",
                    flush=True,
                )
        floor.close()
    finally:
        for proc in (service, floor_service):
            if proc is not None:
                stop_process(proc)
        embedded.stop()
    markdown = (
        "## The route cache per call, against the gRPC + Redis floor\n\n"
        f"`python -m "
        f"benchmarks.performance.bench_route_cache_calls{' --quick' if args.quick else ''}`: "
        f"{args.calls} calls in a row, one at a time, {args.repeats} timed runs, medians (after "
        f"one untimed run). Machine: {machine()}. Qwen3-30B-A3B routes. Milliseconds per call: "
        "wall time, and each process's CPU (user + system; counted in the kernel's 10 ms "
        "ticks over all the timed runs). Floor: the same bytes in the same 1 MiB chunks "
        "through the bare gRPC service keeping them in Redis "
        "(`benchmarks/performance/raw_grpc.py`). "
        "Route cache: a new record written (validated, checksummed, committed and announced) "
        "and read back alone in a batch read (checksums verified, decoded).\n\n" + table(results)
    )
    write_section(args.section, markdown, {"machine": machine(), "results": results})
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
