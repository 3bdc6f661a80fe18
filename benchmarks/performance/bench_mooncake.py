"""The route cache against Mooncake's store (the store Miles, verl, ROLL and vLLM adopt for
rollout data), for the same records, in the same run.

For each geometry (Qwen3-30B-A3B, DeepSeek-V3) and sample length (4K, 32K tokens; ``--quick``:
4K): a batch of records' routes, layer-major (the bytes the route cache stores), is

- written: through the route cache (4 concurrent write streams, as ``bench_route_cache.py``),
  and into Mooncake with one ``batch_put_from`` from a registered buffer;
- read whole: one ``ReadBatch`` (checksums verified, decoded to numpy) against one
  ``batch_get_into`` into a registered buffer;
- read by pipeline stage (the first quarter of the MoE layers, one stage of PP4): a
  ``ReadBatch`` with that layer selection against ``get_into_ranges`` of the same byte range
  of each object (layer-major bytes put a stage in one range: the cheapest way a Mooncake
  user can read a stage without storing it apart).

Mooncake runs as its master (with its HTTP metadata server), a holder process that mounts the
segment the objects live in, and the measuring client (``benchmarks/performance/mooncake_peer.py``),
all
over its TCP transport on this machine, in its own environment (``make mooncake``; needs the
system's libibverbs.so.1 even for TCP: ``apt-get install libibverbs1``). The route cache runs
with its embedded Redis-compatible server, as ``bench_route_cache.py`` does.

The two take turns call by call (``--repeats`` rounds of one call of each, after an untimed
warm-up round), so a drift in the shared machine's load reaches both alike. Prints MiB/s of
route bytes (the median call of each) and route cache / Mooncake ratios (the median of the
rounds' own ratios); Mooncake's calls are timed by its client around the call itself.
Target: the route cache reads a pipeline stage at least as fast as Mooncake serves the same
bytes.

Usage: python -m benchmarks.performance.bench_mooncake [--quick] [--repeats N] [--mooncake-python
PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import numpy as np

from benchmarks.common import machine, write_section
from route_cache.embedded import start_embedded_redis
from routereplay.allocator import keep_large_buffers
from routereplay.dev.launch import free_ports, start_service, stop_process
from routereplay.dev.synthetic import DEEPSEEK_V3, QWEN3_30B_A3B, synthetic_record
from routereplay.domain.codec import contiguous, encode_layer_parts
from routereplay.rpc.client import RouteCacheClient

HERE = Path(__file__).resolve().parent

MIB = 2**20
DEFAULT_PYTHON = HERE.parents[1] / ".venv-mooncake" / "bin" / "python"


class Mooncake:
    """Master and holder processes, and a way to run the measuring client."""

    def __init__(self, python: str, segment_mib: int):
        self.python = python
        bindir = Path(python).parent
        master = bindir / "mooncake_master"
        rpc, http = free_ports(2)
        self.master_addr = f"127.0.0.1:{rpc}"
        self.metadata = f"http://127.0.0.1:{http}/metadata"
        self.logs = tempfile.TemporaryDirectory(prefix="mooncake-")
        log = open(Path(self.logs.name) / "master.log", "w")  # noqa: SIM115 - lives with it
        self.master = subprocess.Popen(
            [
                str(master),
                f"-rpc_port={rpc}",
                "-enable_http_metadata_server=true",
                f"-http_metadata_server_port={http}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        time.sleep(1.5)
        if self.master.poll() is not None:
            raise SystemExit(f"mooncake_master exited: see {log.name}")
        self.holder = subprocess.Popen(
            [python, str(HERE / "mooncake_peer.py"), *self.where(), "--holder"]
            + [f"--segment-mib={segment_mib}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(Path(self.logs.name) / "holder.log", "w"),  # noqa: SIM115
            text=True,
        )
        if self.holder.stdout.readline().strip() != "ready":
            raise SystemExit(
                "Mooncake's holder did not start: "
                + (Path(self.logs.name) / "holder.log").read_text()[-2000:]
            )

    def where(self) -> list[str]:
        return ["--master", self.master_addr, "--metadata", self.metadata]

    def close(self) -> None:
        for process in (self.holder, self.master):
            if process.poll() is None:
                process.terminate()
                try:
                    process.wait(10)
                except subprocess.TimeoutExpired:
                    process.kill()
        self.logs.cleanup()


def check_python(python: str) -> str:
    """Mooncake's interpreter, importable; else the exact error and what to do."""
    if not Path(python).exists():
        raise SystemExit(
            f"no Mooncake environment at {python}: run `make mooncake` (a venv with "
            "mooncake-transfer-engine-non-cuda), or pass --mooncake-python"
        )
    probe = subprocess.run(
        [python, "-c", "from mooncake.store import MooncakeDistributedStore"],
        capture_output=True,
        text=True,
    )
    if probe.returncode != 0:
        hint = (
            " (the wheel links the RDMA library even for TCP: apt-get install libibverbs1)"
            if "libibverbs" in probe.stderr
            else ""
        )
        raise SystemExit(f"Mooncake does not import{hint}:\n{probe.stderr.strip()}")
    return python


class MooncakeClient:
    """``mooncake_peer.py``'s measuring client, serving one call at a time: ``call(op)`` returns
    the seconds Mooncake's own call took, as the client timed it (no pipe in the figure)."""

    def __init__(self, mooncake: Mooncake, records: list[bytes | memoryview], fraction: float):
        self.records = tempfile.NamedTemporaryFile(suffix=".npz")  # noqa: SIM115 - lives with it
        np.savez(
            self.records, **{f"r{i:04d}": np.frombuffer(r, np.uint8) for i, r in enumerate(records)}
        )
        self.records.flush()
        self.log = Path(mooncake.logs.name) / "client.log"
        self.process = subprocess.Popen(
            [mooncake.python, str(HERE / "mooncake_peer.py"), *mooncake.where()]
            + ["--records", self.records.name, f"--stage-fraction={fraction}"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=open(self.log, "w"),  # noqa: SIM115
            text=True,
        )
        self.sizes = json.loads(self._line())

    def _line(self) -> str:
        line = self.process.stdout.readline()
        if not line:
            raise SystemExit(f"Mooncake's client failed:\n{self.log.read_text()[-3000:]}")
        return line

    def call(self, op: str) -> float:
        self.process.stdin.write(op + "\n")
        self.process.stdin.flush()
        return float(self._line())

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(30)
        self.records.close()


def bench_case(args, cache, writers, mooncake, geometry, tokens, rng) -> dict:
    """The route cache and Mooncake taking turns call by call (one call of each per round,
    after an untimed warm-up round), each ratio the median of the rounds' own ratios."""
    batch = 8 if tokens <= 4096 else 4
    pool = [synthetic_record("x", geometry, tokens, rng, skew=1.0) for _ in (0, 1)]
    records = [pool[i % 2] for i in range(batch)]
    route_bytes = sum(r.routes.nbytes for r in records)
    stage = range(geometry.num_moe_layers // 4)
    fraction = len(stage) / geometry.num_moe_layers
    stage_bytes = sum(int(r.routes.nbytes * fraction) for r in records)
    prefix = uuid.uuid4().hex[:8]
    counter = itertools.count()
    ids: list[str] = []

    def forget_previous():
        for sample_id in ids:
            cache.delete(sample_id)

    def service_write():
        ids[:] = [f"moon-{prefix}-{next(counter)}" for _ in records]
        batch_records = [replace(r, sample_id=i) for r, i in zip(records, ids, strict=True)]
        list(writers.map(cache.write, batch_records))

    # Each call with the route bytes it moves; a read is a stream, read whole inside the timing
    # and its bytes checked after it.
    calls = {
        "write": (service_write, route_bytes),
        "read": (lambda: list(cache.read_batch(ids)), route_bytes),
        "stage_read": (lambda: list(cache.read_batch(ids, layers=stage)), stage_bytes),
    }
    layer_major = [contiguous(encode_layer_parts(r.routes)) for r in records]
    peer = MooncakeClient(mooncake, layer_major, fraction)
    assert peer.sizes == {"bytes": route_bytes, "stage_bytes": stage_bytes}
    times = {(side, op): [] for side in ("cache", "mooncake") for op in calls}
    try:
        for round_ in range(args.repeats + 1):  # round 0: the warm-up, untimed
            for op, (call, size) in calls.items():
                if op == "write":
                    forget_previous()  # untimed
                start = time.perf_counter()
                got = call()
                elapsed = time.perf_counter() - start, peer.call(op)
                assert got is None or sum(r.routes.nbytes for r in got) == size
                if round_:
                    times["cache", op].append(elapsed[0])
                    times["mooncake", op].append(elapsed[1])
    finally:
        peer.close()
        forget_previous()
    result = {"geometry": geometry.model_id, "tokens": tokens, "batch": batch}
    for op, (_, size) in calls.items():
        for side in ("cache", "mooncake"):
            result[f"{side}_{op}_mibs"] = size / statistics.median(times[side, op]) / MIB
        result[f"{op}_ratio"] = statistics.median(
            m / c for c, m in zip(times["cache", op], times["mooncake", op], strict=True)
        )
    return result


def table(results: list[dict]) -> str:
    lines = [
        "| geometry | tokens | **route cache / Mooncake: write / read / stage read** "
        "| route cache MiB/s write / read / stage read | Mooncake MiB/s write / read / "
        "stage read |",
        "|---" * 5 + "|",
    ]
    for r in results:
        lines.append(
            f"| {r['geometry']} | {r['tokens']} "
            f"| **{r['write_ratio']:.2f} / {r['read_ratio']:.2f} / {r['stage_read_ratio']:.2f}** "
            f"| {r['cache_write_mibs']:.0f} / {r['cache_read_mibs']:.0f} / "
            f"{r['cache_stage_read_mibs']:.0f} "
            f"| {r['mooncake_write_mibs']:.0f} / {r['mooncake_read_mibs']:.0f} / "
            f"{r['mooncake_stage_read_mibs']:.0f} |"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="4K tokens only, 3 repeats")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--writers", type=int, default=4)
    parser.add_argument(
        "--mooncake-python", default=os.environ.get("MOONCAKE_PYTHON", str(DEFAULT_PYTHON))
    )
    parser.add_argument("--section", default="mooncake")
    parser.add_argument("--segment-mib", type=int, default=1024)
    args = parser.parse_args()
    if args.quick:
        args.repeats = 3
    python = check_python(args.mooncake_python)
    keep_large_buffers()
    embedded, url = start_embedded_redis()
    server = mooncake = None
    results = []
    try:
        server, target = start_service(
            "route_cache", "--redis-url", url, "--ttl-s", "600", quiet=True
        )
        mooncake = Mooncake(python, segment_mib=args.segment_mib)
        rng = np.random.default_rng(0)
        with (
            RouteCacheClient(target, timeout_s=120) as cache,
            ThreadPoolExecutor(args.writers) as writers,
        ):
            for geometry, tokens in itertools.product(
                (QWEN3_30B_A3B, DEEPSEEK_V3), (4096,) if args.quick else (4096, 32768)
            ):
                r = bench_case(args, cache, writers, mooncake, geometry, tokens, rng)
                results.append(r)
                print(
                    f"{r['geometry']} {tokens}: route cache / Mooncake write "
                    f"{r['write_ratio']:.2f}, read {r['read_ratio']:.2f}, stage read "
                    f"{r['stage_read_ratio']:.2f}",
                    flush=True,
                )
    finally:
        if mooncake is not None:
            mooncake.close()
        if server is not None:
            stop_process(server)
        embedded.stop()
    version = subprocess.run(
        [python, "-m", "pip", "show", "mooncake-transfer-engine-non-cuda"],
        capture_output=True,
        text=True,
    ).stdout
    version = next((v.split()[-1] for v in version.splitlines() if v.startswith("Version")), "?")
    markdown = (
        "## Against Mooncake's store: the same records\n\n"
        f"`python -m benchmarks.performance.bench_mooncake{' --quick' if args.quick else ''}`, "
        f"{args.repeats} rounds, the two systems taking turns call by call after an untimed "
        "warm-up round; MiB/s the median call, ratios the median of the rounds' own ratios "
        "(Mooncake's calls timed by its client around the call itself). "
        f"Machine: {machine()}; "
        f"mooncake-transfer-engine-non-cuda {version} (master with its HTTP metadata server, "
        f"a holder process mounting a segment of {args.segment_mib} MiB, the measuring client; "
        "TCP transport), the "
        "route cache over its embedded Redis-compatible server; all on this machine's cores, "
        "shared with other work. MiB/s of route bytes (uint8, layer-major as the route cache "
        "stores them). Write: the route cache's 4 concurrent write streams (validated, "
        "checksummed, ids checked) against one `batch_put_from` of a registered buffer. Read: "
        "one `ReadBatch` (checksums verified, decoded) against one `batch_get_into`. Stage read: "
        "the first quarter of the MoE layers (one stage of PP4): `ReadBatch` with that layer "
        "selection against `get_into_ranges` of the same byte range of each object. Target: "
        "stage read >= 1.0.\n\n" + table(results)
    )
    write_section(args.section, markdown, {"machine": machine(), "results": results})
    print(markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
