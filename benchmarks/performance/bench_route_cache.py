"""Route cache throughput against raw redis-py on the same bytes, and stored bytes per token.

For each geometry (Qwen3-30B-A3B, DeepSeek-V3), sample length (4K, 32K tokens) and route
distribution (uniform, Zipf-like per layer), in the same run against the same Redis:

- raw redis-py: the records' uint8 route bytes through redis-py pipelines (SET all, then GET
  all);
- raw gRPC: the same bytes streamed in the same 1 MiB chunks, with the same concurrency and
  channel options, to a trivial bytes-in/bytes-out gRPC service that keeps them in memory and
  streams them back in one batch call (``benchmarks/performance/raw_grpc.py``): the transport's
  floor;
- gRPC + Redis: the same trivial service keeping the bytes in Redis (one SET per record, one
  GET per record on read, the next GET overlapping the send): the floor of any route cache
  made of these two parts, with no checks, checksums or layout;
- service: the records written one by one through the route cache (validated, checksummed,
  chunked over gRPC, committed by Lua) and read back in one ReadBatch stream (checksums
  verified, decoded to numpy); and the same batch read with a layer selection of a quarter of
  the MoE layers (what one stage of a 4-stage pipeline reads), in MiB/s of the bytes it reads,
  beside the gRPC + Redis service reading the same share of each value (one GETRANGE per
  record): what a stage read of these records can reach against a whole read at all.

With ``--pin-service CPU`` the three gRPC services (the route cache and both bare ones) run
on that core alone and this process on the others: the service's own cost without the client
and Redis competing for its core.

Prints and records median throughput over repeats, the service/redis-py ratio (target: at
least 0.5 for write and batch read), the service/raw gRPC ratio (target 0.8) and the
service/gRPC + Redis ratio (what the route cache's own work costs), and bytes per token of
the routes as int32, int16, raw uint8 and this project's stored forms (target: at most raw
uint8).

Usage: python -m benchmarks.performance.bench_route_cache [--quick] [--redis-url URL] [--pin-service
CPU]
"""

from __future__ import annotations

import argparse
import itertools
import os
import subprocess
import sys
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import redis

from benchmarks.common import (
    Run,
    interleaved,
    machine,
    median_time,
    paired_ratio,
    write_section,
)
from benchmarks.performance.raw_grpc import RawClient
from route_cache.embedded import start_embedded_redis
from route_cache.record_format import record_key, routes_key
from routereplay.allocator import keep_large_buffers
from routereplay.dev.launch import start_service, stop_process
from routereplay.dev.synthetic import DEEPSEEK_V3, QWEN3_30B_A3B, synthetic_record
from routereplay.domain.codec import Encoding
from routereplay.rpc.chunks import DEFAULT_CHUNK_BYTES
from routereplay.rpc.client import RouteCacheClient
from tests.support.records import encode_routes

MIB = 2**20
# Of the gRPC + Redis floor (the same bytes through a bare gRPC service keeping them in Redis):
# writes and batch reads; stage reads of the whole read's MiB/s.
TARGET_WRITE, TARGET_READ, TARGET_STAGE = 0.8, 0.9, 0.9
DISTRIBUTIONS = {"uniform": 0.0, "zipf": 1.0}
# The processes whose CPU the tables give, in their columns' order.
ROLES = ("client", "server", "redis")


def bench_case(
    args, raw_client, grpc_client, floor_client, cache, writers, pids, geometry, tokens, dist, rng
):
    """One case's figures. ``pids``: the processes whose CPU is counted (this client, the
    route cache, the gRPC + Redis floor, Redis; None where unknown)."""
    batch = 8 if tokens <= 4096 else 4
    # Two distinct records, cycled: generating 32K-token routes is slower than storing them.
    pool = [synthetic_record("x", geometry, tokens, rng, skew=DISTRIBUTIONS[dist]) for _ in (0, 1)]
    records = [pool[i % 2] for i in range(batch)]
    route_bytes = sum(r.routes.nbytes for r in records)
    payloads = [r.routes.tobytes() for r in records]
    prefix = uuid.uuid4().hex[:8]
    counter = itertools.count()

    def raw_keys():
        return [f"raw:{prefix}:{i}" for i in range(batch)]

    def raw_write():
        pipe = raw_client.pipeline(transaction=False)
        for key, data in zip(raw_keys(), payloads, strict=True):
            pipe.set(key, data)
        pipe.execute()

    def raw_read():
        pipe = raw_client.pipeline(transaction=False)
        for key in raw_keys():
            pipe.get(key)
        assert sum(len(v) for v in pipe.execute()) == route_bytes

    result = {"geometry": geometry.model_id, "tokens": tokens, "dist": dist, "batch": batch}
    chunked = [
        [p[i : i + DEFAULT_CHUNK_BYTES] for i in range(0, len(p), DEFAULT_CHUNK_BYTES)]
        for p in payloads
    ]
    grpc_keys = [str(i) for i in range(batch)]  # reused by every case: bounded server memory
    stage = range(geometry.num_moe_layers // 4)  # one stage of a 4-stage pipeline
    stage_bytes = route_bytes * len(stage) // geometry.num_moe_layers
    ids: list[str] = []

    def roles(server: str | None) -> dict[str, int | None]:
        named = {"client": pids["client"], "redis": pids["redis"]}
        return named if server is None else {**named, "server": pids[server]}

    def bare_write(client):
        assert sum(writers.map(client.write, grpc_keys, chunked)) == route_bytes

    def bare_read(client, share=None, expected=route_bytes):
        assert sum(len(c) for c in client.read_batch(grpc_keys, share)) == expected

    def forget_previous():
        # Redis reuses the memory of deleted records, as it does in a fleet at steady
        # state where records expire; ever new records would have it fault in fresh pages
        # (a 12 MB SET: 2-4 ms into reused memory, up to 37 ms into fresh), which the
        # baselines, overwriting their keys, never do. Both keys of each record: the
        # routes value is the large one.
        if ids:
            raw_client.delete(*(k for i in ids for k in (record_key(i), routes_key(i))))

    def service_write():
        # The batch's records in flight together, as a rollout fleet writes them.
        ids[:] = [f"bench-{prefix}-{next(counter)}" for _ in records]
        batch = [replace(r, sample_id=i) for r, i in zip(records, ids, strict=True)]
        list(writers.map(cache.write, batch))

    def service_read():
        got = list(cache.read_batch(ids))
        assert sum(r.routes.nbytes for r in got) == route_bytes

    def service_stage_read():
        got = list(cache.read_batch(ids, layers=stage))
        assert sum(r.routes.nbytes for r in got) == stage_bytes

    # The route cache (RAW) and its baselines take turns, call by call: each ratio compares
    # calls made under the same load. The floor's stage read: the same share of each value,
    # from its start (a GETRANGE per record).
    cache.encoding = Encoding.RAW
    share = (0, stage_bytes // batch)
    writes = interleaved(
        {
            "redis": Run(raw_write, roles(None)),
            "grpc": Run(lambda: bare_write(grpc_client), roles("grpc")),
            "floor": Run(lambda: bare_write(floor_client), roles("floor")),
            "service_raw": Run(service_write, roles("service"), forget_previous),
        },
        args.repeats,
    )
    reads = interleaved(
        {
            "redis": Run(raw_read, roles(None)),
            "grpc": Run(lambda: bare_read(grpc_client), roles("grpc")),
            "floor": Run(lambda: bare_read(floor_client), roles("floor")),
            "floor_stage": Run(lambda: bare_read(floor_client, share, stage_bytes), {}),
            "service_raw": Run(service_read, roles("service")),
            "service_raw_stage": Run(service_stage_read, {}),
        },
        args.repeats,
    )
    raw_client.delete(*raw_keys())
    for op, timings in (("write", writes), ("read", reads)):
        for name, t in timings.items():
            moved = stage_bytes if name.endswith("stage") else route_bytes
            result[f"{name}_{op}_mibs"] = moved / t.median / MIB
            # CPU per MiB moved: ms/MiB (= s/GiB)
            result[f"{name}_{op}_cpu"] = {
                role: None if cpu is None else cpu * 1e3 / (moved / MIB)
                for role, cpu in t.cpu.items()
            }
        service = timings["service_raw"]
        result[f"{op}_ratio"] = paired_ratio(service, timings["redis"])
        result[f"{op}_ratio_grpc"] = paired_ratio(service, timings["grpc"])
        result[f"{op}_ratio_floor"] = paired_ratio(service, timings["floor"])
        result[f"floor_{op}_ratio_grpc"] = paired_ratio(timings["floor"], timings["grpc"])
    fraction = stage_bytes / route_bytes  # a stage's share of the bytes
    result["stage_ratio_whole"] = paired_ratio(
        reads["service_raw_stage"], reads["service_raw"], fraction
    )
    result["floor_stage_ratio_whole"] = paired_ratio(reads["floor_stage"], reads["floor"], fraction)
    result["stage_ratio_floor"] = paired_ratio(reads["service_raw_stage"], reads["floor_stage"])
    result["stage_read_ratio_grpc"] = paired_ratio(
        reads["service_raw_stage"], reads["grpc"], fraction
    )
    stat = cache.stat(ids[0])
    result["service_raw_record_bytes_per_token"] = stat.stored_bytes / stat.num_tokens
    result["service_raw_route_bytes_per_token"] = route_bytes / batch / records[0].num_tokens

    # ZSTD, on its own: what compression costs, not held against a baseline.
    cache.encoding = Encoding.ZSTD
    result["service_zstd_write_mibs"] = (
        route_bytes / median_time(service_write, args.repeats, forget_previous) / MIB
    )
    result["service_zstd_read_mibs"] = route_bytes / median_time(service_read, args.repeats) / MIB
    result["service_zstd_stage_read_mibs"] = (
        stage_bytes / median_time(service_stage_read, args.repeats) / MIB
    )
    stat = cache.stat(ids[0])
    result["service_zstd_record_bytes_per_token"] = stat.stored_bytes / stat.num_tokens
    encoded = encode_routes(records[0].routes, Encoding.ZSTD)
    result["service_zstd_route_bytes_per_token"] = len(encoded.data) / records[0].num_tokens
    cache.encoding = Encoding.RAW
    for key in raw_client.scan_iter(match=f"rr:{{bench-{prefix}-*"):
        raw_client.delete(key)
    lk = geometry.num_moe_layers * geometry.topk
    result.update(
        int32_bytes_per_token=4 * lk,
        int16_bytes_per_token=2 * lk,
        uint8_bytes_per_token=lk * geometry.dtype.itemsize,
    )
    result["meets_targets"] = (
        result["write_ratio_floor"] >= TARGET_WRITE
        and result["read_ratio_floor"] >= TARGET_READ
        and result["stage_ratio_whole"] >= TARGET_STAGE
    )
    return result


def table(results: list[dict]) -> str:
    lines = [
        "| geometry | tokens | routes | **service / gRPC + Redis write / read** "
        "| **stage read / whole read** | gRPC + Redis: stage read / whole read "
        "| service / gRPC + Redis stage read | service / raw gRPC write / read "
        "| gRPC + Redis / raw gRPC write / read | service / redis-py write / read "
        "| raw gRPC write / read | gRPC + Redis write / read "
        "| service write / read / stage read | redis-py write / read "
        "| service zstd write / read / stage read |",
        "|---" * 15 + "|",
    ]
    for r in results:
        lines.append(
            f"| {r['geometry']} | {r['tokens']} | {r['dist']} "
            f"| **{r['write_ratio_floor']:.2f} / {r['read_ratio_floor']:.2f}** "
            f"| **{r['stage_ratio_whole']:.2f}** "
            f"| {r['floor_stage_ratio_whole']:.2f} | {r['stage_ratio_floor']:.2f} "
            f"| {r['write_ratio_grpc']:.2f} / {r['read_ratio_grpc']:.2f} "
            f"| {r['floor_write_ratio_grpc']:.2f} / {r['floor_read_ratio_grpc']:.2f} "
            f"| {r['write_ratio']:.2f} / {r['read_ratio']:.2f} "
            f"| {r['grpc_write_mibs']:.0f} / {r['grpc_read_mibs']:.0f} "
            f"| {r['floor_write_mibs']:.0f} / {r['floor_read_mibs']:.0f} "
            f"| {r['service_raw_write_mibs']:.0f} / {r['service_raw_read_mibs']:.0f} / "
            f"{r['service_raw_stage_read_mibs']:.0f} "
            f"| {r['redis_write_mibs']:.0f} / {r['redis_read_mibs']:.0f} "
            f"| {r['service_zstd_write_mibs']:.0f} / {r['service_zstd_read_mibs']:.0f} / "
            f"{r['service_zstd_stage_read_mibs']:.0f} |"
        )
    lines += [
        "",
        "| geometry | tokens | routes | int32 / int16 / uint8 | stored routes raw / zstd "
        "| stored record |",
        "|---" * 6 + "|",
    ]
    for r in results:
        lines.append(
            f"| {r['geometry']} | {r['tokens']} | {r['dist']} "
            f"| {r['int32_bytes_per_token']} / {r['int16_bytes_per_token']} / "
            f"{r['uint8_bytes_per_token']} "
            f"| {r['service_raw_route_bytes_per_token']:.0f} / "
            f"{r['service_zstd_route_bytes_per_token']:.0f} "
            f"| {r['service_raw_record_bytes_per_token']:.0f} |"
        )
    lines += [
        "",
        "CPU per MiB of routes moved (ms/MiB, each process's user + system time over the "
        "measurement's timed runs, its warm-up left out), by process: client / server / Redis, "
        "the route cache's (RAW) against the gRPC + Redis floor's.",
        "",
        "| geometry | tokens | routes | write: service | write: floor "
        "| **write: service / floor, all processes** | read: service | read: floor "
        "| **read: service / floor, all processes** |",
        "|---" * 9 + "|",
    ]
    for r in results:
        cells = []
        for op in ("write", "read"):
            service, floor = r[f"service_raw_{op}_cpu"], r[f"floor_{op}_cpu"]
            cells += [_cpu_cell(service), _cpu_cell(floor), f"**{_cpu_ratio(service, floor)}**"]
        lines.append(
            f"| {r['geometry']} | {r['tokens']} | {r['dist']} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def _cpu_cell(cpu: dict) -> str:
    """A process's CPU figures in the tables' order (``ROLES``), whatever order they came in."""
    return " / ".join("-" if cpu.get(r) is None else f"{cpu[r]:.2f}" for r in ROLES)


def _cpu_ratio(service: dict, floor: dict) -> str:
    """The service's CPU over the floor's, summed over the processes both could count."""
    known = [k for k in service if service[k] is not None and floor[k] is not None]
    total = sum(floor[k] for k in known)
    return f"{sum(service[k] for k in known) / total:.2f}" if total else "-"


def pin(cpu: int, pids: list[int | None]) -> None:
    """Every thread of the service processes on ``cpu``; this process and Redis (the last
    pid) elsewhere."""
    service_pids = [p for p in pids[:-1] if p is not None]
    for pid in service_pids:
        subprocess.run(
            ["taskset", "-a", "-p", "-c", str(cpu), str(pid)], check=True, stdout=subprocess.DEVNULL
        )
    others = set(range(os.cpu_count() or 1)) - {cpu}
    if not others:
        raise SystemExit("--pin-service needs at least 2 cores")
    os.sched_setaffinity(0, others)
    if pids[-1] is not None:
        subprocess.run(
            ["taskset", "-a", "-p", "-c", ",".join(map(str, sorted(others))), str(pids[-1])],
            check=True,
            stdout=subprocess.DEVNULL,
        )


def embedded_pid(embedded) -> int | None:
    """The embedded Redis server's process id, where it has one we can name."""
    process = getattr(embedded, "process", None) or getattr(embedded, "_process", None)
    return getattr(process, "pid", None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--redis-url", default="", help="default: an embedded server")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--writers", type=int, default=4, help="concurrent write streams")
    parser.add_argument("--quick", action="store_true", help="4K tokens only")
    parser.add_argument(
        "--pin-service",
        type=int,
        default=None,
        metavar="CPU",
        help="run both gRPC services on this core alone, the rest elsewhere",
    )
    parser.add_argument(
        "--section", default="route_cache", help="the docs/benchmarks.md section to write"
    )
    args = parser.parse_args()
    if args.quick:
        args.repeats = 5
    keep_large_buffers()  # this process reads as a trainer does, and trainers set it too
    embedded = None
    url = args.redis_url
    if not url:
        embedded, url = start_embedded_redis()
    server = raw_server = floor_server = None
    results = []
    try:
        server, target = start_service(
            "route_cache", "--redis-url", url, "--ttl-s", "600", quiet=True
        )
        raw_server, raw_target = start_service("benchmarks.performance.raw_grpc", quiet=True)
        floor_server, floor_target = start_service(
            "benchmarks.performance.raw_grpc", "--redis-url", url, quiet=True
        )
        if args.pin_service is not None:
            pin(
                args.pin_service,
                [server.pid, raw_server.pid, floor_server.pid, embedded_pid(embedded)],
            )
        grpc_client, floor_client = RawClient(raw_target), RawClient(floor_target)
        pids = {
            "client": os.getpid(),
            "service": server.pid,
            "grpc": raw_server.pid,
            "floor": floor_server.pid,
            "redis": embedded_pid(embedded),
        }
        raw_client = redis.Redis.from_url(url)
        redis_version = raw_client.info("server").get("redis_version")
        rng = np.random.default_rng(0)
        with (
            RouteCacheClient(target, timeout_s=120) as cache,
            ThreadPoolExecutor(args.writers) as writers,
        ):
            for geometry, tokens, dist in itertools.product(
                (QWEN3_30B_A3B, DEEPSEEK_V3),
                (4096,) if args.quick else (4096, 32768),
                DISTRIBUTIONS,
            ):
                r = bench_case(
                    args,
                    raw_client,
                    grpc_client,
                    floor_client,
                    cache,
                    writers,
                    pids,
                    geometry,
                    tokens,
                    dist,
                    rng,
                )
                results.append(r)
                print(
                    f"{r['geometry']} {tokens} {dist}: service/redis-py write "
                    f"{r['write_ratio']:.2f}, read {r['read_ratio']:.2f}; service/raw gRPC "
                    f"write {r['write_ratio_grpc']:.2f}, "
                    f"read {r['read_ratio_grpc']:.2f}; service/gRPC + Redis write "
                    f"{r['write_ratio_floor']:.2f} (target {TARGET_WRITE}), "
                    f"read {r['read_ratio_floor']:.2f} (target {TARGET_READ}); stage/whole read "
                    f"{r['stage_ratio_whole']:.2f} (target {TARGET_STAGE}; the floor's own "
                    f"{r['floor_stage_ratio_whole']:.2f})",
                    flush=True,
                )
        grpc_client.close()
        floor_client.close()
    finally:
        for proc in (server, raw_server, floor_server):
            if proc is not None:
                stop_process(proc)
        if embedded is not None:
            embedded.stop()
    pinned = (
        f" **Pinned**: the three gRPC services (route cache, bare, bare + Redis) on core "
        f"{args.pin_service} alone (`taskset -a`), "
        "the benchmark client and Redis on the other cores."
        if args.pin_service is not None
        else " Client, services and Redis share the machine's cores."
    )
    markdown = (
        f"## Route cache against raw redis-py and raw gRPC"
        f"{' (service pinned to its own core)' if args.pin_service is not None else ''}\n\n"
        f"`make bench` (`python -m "
        f"benchmarks.performance.bench_route_cache{' --quick' if args.quick else ''}"
        f"`), {args.repeats} rounds, the route cache (RAW) and its baselines timed in turns, one "
        "call of each per round; MiB/s are medians, ratios the medians of the rounds' own ratios "
        f"(ZSTD timed on its own). Machine: {machine()}; Redis-compatible server "
        f"{redis_version}. Throughput in MiB/s of route bytes; bytes per token of routes."
        f"{pinned}\n"
        f"Write: the batch written through the service as {args.writers} concurrent streams "
        "(validated, checksummed, 1 MiB chunks over gRPC, staged and committed in Redis) "
        "against one redis-py pipeline of SETs of the same bytes, and against the same bytes "
        f"in the same chunks as {args.writers} concurrent streams to a trivial bytes-in/bytes-out "
        "gRPC service on the same server plumbing and channel options, which keeps them in "
        "memory (`benchmarks/performance/raw_grpc.py`), and to the same service keeping them in "
        "Redis "
        "(gRPC + Redis: one SET per record; the floor of any route cache made of these two "
        "parts). Read: one ReadBatch stream (checksums verified, decoded to numpy) against one "
        "pipeline of GETs, one raw gRPC stream of the stored chunks, and the gRPC + Redis "
        "service's stream (one GET per record, the next overlapping the send). Stage read: "
        "the same ReadBatch with a layer selection of the first quarter "
        "of the MoE layers (one stage of 4), in MiB/s of the bytes it reads, against the gRPC "
        "+ Redis service reading the same share of each value (one GETRANGE per record). "
        "Targets: service "
        f"/ gRPC + Redis >= {TARGET_WRITE} on writes and >= {TARGET_READ} on batch reads; "
        f"stage read / whole read >= {TARGET_STAGE}; stored <= uint8.\n\n" + table(results)
    )
    write_section(args.section, markdown, {"machine": machine(), "results": results})
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
