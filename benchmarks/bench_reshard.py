"""Reshard time per batch: one rank's share of the routes for several parallel layouts.

Qwen3-30B-A3B geometry (48 MoE layers, top-8 of 128 experts: 384 bytes per token as uint8),
8 samples of 32K tokens per rank, packed (THD) into micro-batches by a token budget. For each
layout the timed work is what a rank does per batch after fetching its records: dynamic
batching, then per micro-batch packing plan, this stage's layers, CP chunks and SP share
(``trainer.reshard.reshard_packed_routes``), and optionally the per-router int64 tensors
megatron's ``RouterReplay`` takes (``router_tensors``). The baseline is a plain copy of the
same bytes (the rank's records' routes, one ``np.copyto`` per record) in the same run.

Run: ``python benchmarks/bench_reshard.py`` (writes the ``reshard`` section of
docs/benchmarks.md and results/reshard.json; ``--dry-run`` only prints).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time

import numpy as np

from benchmarks.common import write_section
from trainer.reshard import (
    ROUTE_DTYPE,
    Layout,
    PipelineSplit,
    RankCoords,
    dynamic_microbatches,
    reshard_packed_routes,
    router_tensors,
)

LAYERS, TOPK, EXPERTS = 48, 8, 128
HOST = np.dtype(ROUTE_DTYPE).name  # the routes' dtype on the host while resharding
LAYOUTS = {
    "TP1 (pack only)": (Layout(), RankCoords()),
    "TP2+SP": (Layout(tp=2, sequence_parallel=True), RankCoords(tp_rank=1)),
    "CP2": (Layout(cp=2), RankCoords(cp_rank=1)),
    "TP2+SP+CP2": (Layout(tp=2, cp=2, sequence_parallel=True), RankCoords(tp_rank=1, cp_rank=1)),
    "PP4": (Layout(pp=4), RankCoords(pp_rank=2)),
    "PP4 x VP2": (Layout(pp=4, vp=2), RankCoords(pp_rank=2, vp_stage=1)),
}


def _times(fn, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32 * 1024, help="tokens per sample")
    parser.add_argument("--samples", type=int, default=8, help="samples per rank")
    parser.add_argument("--budget", type=int, default=64 * 1024, help="tokens per micro-batch")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dry-run", action="store_true", help="print, write nothing")
    args = parser.parse_args()

    rng = np.random.default_rng(0)
    # Odd lengths around the target, as real batches have (each padded by the layout).
    lengths = [args.tokens - int(d) for d in rng.integers(0, 64, args.samples)]
    routes = [rng.integers(0, EXPERTS, (n - 1, LAYERS, TOPK), dtype=np.uint8) for n in lengths]
    moe_layers = tuple(range(LAYERS))
    nbytes = sum(r.nbytes for r in routes)
    copies = [np.empty_like(r) for r in routes]

    def plain_copy():
        for src, dst in zip(routes, copies, strict=True):
            np.copyto(dst, src)

    copy_times = _times(plain_copy, args.repeats)
    results: dict = {
        "geometry": {"layers": LAYERS, "topk": TOPK, "experts": EXPERTS},
        "tokens_per_sample": args.tokens,
        "samples_per_rank": args.samples,
        "budget": args.budget,
        "bytes_per_rank": nbytes,
        "copy_s_median": statistics.median(copy_times),
        "layouts": {},
    }
    for name, (layout, coords) in LAYOUTS.items():
        split = PipelineSplit(LAYERS, pp=layout.pp, vp=layout.vp)
        out_bytes = [0, 0]

        def reshard(
            with_int64: bool, layout=layout, coords=coords, split=split, out_bytes=out_bytes
        ):
            batches = dynamic_microbatches(lengths, args.budget, multiple=layout.multiple)
            out_bytes[:] = [0, 0]
            for group in batches.groups:
                local, _, _ = reshard_packed_routes(
                    [routes[i] for i in group],
                    [lengths[i] for i in group],
                    moe_layers,
                    split,
                    layout,
                    coords,
                )
                out_bytes[0] += local.nbytes
                if with_int64:
                    tensors = router_tensors(local)
                    out_bytes[1] += sum(t.numel() * t.element_size() for t in tensors)

        shard = _times(lambda: reshard(False), args.repeats)
        full = _times(lambda: reshard(True), args.repeats)
        results["layouts"][name] = {
            "reshard_s_median": statistics.median(shard),
            "reshard_int64_s_median": statistics.median(full),
            "local_bytes": out_bytes[0],
            "local_bytes_int64": out_bytes[1],
            "ratio_to_copy": statistics.median(shard) / results["copy_s_median"],
            "ratio_int64_to_copy": statistics.median(full) / results["copy_s_median"],
        }
        print(name, results["layouts"][name], flush=True)

    copy_ms = 1000 * results["copy_s_median"]
    rows = [
        f"| {name} | {1000 * r['reshard_s_median']:.1f} | {r['ratio_to_copy']:.2f} | "
        f"{r['local_bytes'] / 2**20:.0f} | {1000 * r['reshard_int64_s_median']:.1f} | "
        f"{r['ratio_int64_to_copy']:.2f} |"
        for name, r in results["layouts"].items()
    ]
    markdown = "\n".join(
        [
            "## Resharding routes for one rank (`benchmarks/bench_reshard.py`)",
            "",
            f"Qwen3-30B-A3B geometry ({LAYERS} MoE layers, top-{TOPK} of {EXPERTS}), "
            f"{args.samples} samples of about {args.tokens} tokens per rank "
            f"({nbytes / 2**20:.0f} MiB of uint8 routes), packed into micro-batches of at most "
            f"{args.budget} tokens; medians of {args.repeats} runs. Baseline: a plain copy of "
            f"the same bytes in the same run, **{copy_ms:.1f} ms**. 'reshard' = dynamic "
            f"batching + packing + this stage's layers + CP chunks + SP share into {HOST}; "
            "'+ int64' adds megatron's per-router int64 tensors (8x the bytes of uint8).",
            "",
            f"| layout (rank shown) | reshard ms | x copy | local MiB ({HOST}) | + int64 ms "
            "| x copy |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()}, numpy {np.__version__}; one thread.",
        ]
    )
    print(markdown)
    if not args.dry_run:
        write_section("reshard", markdown, results)


if __name__ == "__main__":
    main()
