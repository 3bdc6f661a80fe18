"""Layout time per batch: one rank's micro-batches and replay ids for several parallel layouts.

Qwen3-30B-A3B geometry (48 MoE layers, top-8 of 128 experts: 384 bytes per token as uint8),
8 samples of 32K tokens per rank, packed into micro-batches by a token budget. For each layout
the timed work is what the RL step calls per batch after fetching its records,
``trainer.layout.plan_step``: micro-batches under the budget, each packed to the layout's
multiple with its per-token tensors, its records aligned to per-router replay ids for this
stage's routers (int16: ``replay_dtype``; each router widens its own to megatron's int64 on
the device), then cut to this rank's CP chunks and SP share. The baseline is a
plain copy of the same route bytes (the rank's records' routes, one ``np.copyto`` per record)
in the same run.

Run: ``python -m benchmarks.performance.bench_reshard`` (writes the ``reshard`` section of
docs/benchmarks.md and results/reshard.json; ``--dry-run`` only prints).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics

import numpy as np
import torch

from benchmarks.common import wall_times, write_section
from routereplay.domain.record import Geometry, Record, Turn
from trainer.config import TrainConfig
from trainer.data.source import Sample
from trainer.distributed.dp import DataParallel, ModelParallel
from trainer.layout import RankShare, plan_step
from trainer.sharding import (
    Parallelism,
    ParallelismError,
    PipelineSplit,
    RankCoords,
    stage_moe_layers,
)

LAYERS, TOPK, EXPERTS = 48, 8, 128
LAYOUTS = {
    "TP1": (Parallelism(), RankCoords()),
    "TP2+SP": (Parallelism(tp=2, sequence_parallel=True), RankCoords(tp_rank=1)),
    "CP2": (Parallelism(cp=2), RankCoords(cp_rank=1)),
    "TP2+SP+CP2": (
        Parallelism(tp=2, cp=2, sequence_parallel=True),
        RankCoords(tp_rank=1, cp_rank=1),
    ),
    "PP4": (Parallelism(pp=4), RankCoords(pp_rank=2)),
    "PP4 x VP2": (Parallelism(pp=4, vp=2), RankCoords(pp_rank=2, vp_stage=1)),
}


def _batch(lengths: list[int], seed: int = 0) -> tuple[list[Record], list[Sample]]:
    """One rank's records (random routes, one turn generated after the first token) and the
    samples the step trains on."""
    rng = np.random.default_rng(seed)
    geometry = Geometry(tuple(range(LAYERS)), TOPK, EXPERTS, "bench")
    records = []
    for i, n in enumerate(lengths):
        tokens = rng.integers(0, 32000, n, dtype=np.int32)
        routes = rng.integers(0, EXPERTS, (n - 1, LAYERS, TOPK), dtype=np.uint8)
        turn = Turn(0, n, 1, 0, np.zeros(n - 1, np.float32))
        records.append(Record(f"s{i}", geometry, tokens, routes, [turn], f"g{i // 2}"))
    return records, [Sample.from_record(r) for r in records]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32 * 1024, help="tokens per sample")
    parser.add_argument("--samples", type=int, default=8, help="samples per rank")
    parser.add_argument("--budget", type=int, default=64 * 1024, help="tokens per micro-batch")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--dry-run", action="store_true", help="print, write nothing")
    args = parser.parse_args()
    torch.set_num_threads(1)

    rng = np.random.default_rng(0)
    # Odd lengths around the target, as real batches have (each padded by the layout).
    lengths = [args.tokens - int(d) for d in rng.integers(0, 64, args.samples)]
    records, samples = _batch(lengths)
    geometry = records[0].geometry
    nbytes = sum(r.routes.nbytes for r in records)
    copies = [np.empty_like(r.routes) for r in records]

    def plain_copy():
        for src, dst in zip(records, copies, strict=True):
            np.copyto(dst, src.routes)

    # One mini-batch of every sample, packed under the budget: what train.packing=true with
    # train.max_tokens_per_micro_batch gives.
    train = TrainConfig(
        batch_size=args.samples,
        micro_batch_size=args.samples,
        max_tokens_per_micro_batch=args.budget,
        packing=True,
    )
    advantages = np.zeros(args.samples, np.float32)
    copy_times = wall_times(plain_copy, args.repeats)
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
        routers = stage_moe_layers(split, geometry.moe_layers, coords.pp_rank, coords.vp_stage)
        share = RankShare(ModelParallel(layout, coords, tp_group=None, expert_dp_group=None))
        out: dict = {}

        def plan(share=share, routers=routers, out=out):
            laid = plan_step(
                samples,
                records,
                advantages,
                train=train,
                dp=DataParallel(),
                share=share,
                geometry=geometry,
                router_layers=routers,
            )
            out["micro_batches"] = len(laid.micro_batches)
            out["local_bytes"] = sum(
                t.numel() * t.element_size() for ids in laid.replay_ids for t in ids
            )

        try:
            times = wall_times(plan, args.repeats)
        except ParallelismError as exc:  # e.g. virtual stages need a multiple of pp micro-batches
            results["layouts"][name] = {"refused": str(exc)}
            print(name, "refused:", exc, flush=True)
            continue
        results["layouts"][name] = {
            "plan_s_median": statistics.median(times),
            "ratio_to_copy": statistics.median(times) / results["copy_s_median"],
            "routers": len(routers),
            **out,
        }
        print(name, results["layouts"][name], flush=True)

    copy_ms = 1000 * results["copy_s_median"]
    rows = [
        f"| {name} | refused: {r['refused']} | | | | |"
        if "refused" in r
        else f"| {name} | {r['routers']} | {r['micro_batches']} | "
        f"{1000 * r['plan_s_median']:.1f} | {r['ratio_to_copy']:.1f} | "
        f"{r['local_bytes'] / 2**20:.0f} |"
        for name, r in results["layouts"].items()
    ]
    markdown = "\n".join(
        [
            "## One rank's layout of a batch (`benchmarks/performance/bench_reshard.py`)",
            "",
            f"Qwen3-30B-A3B geometry ({LAYERS} MoE layers, top-{TOPK} of {EXPERTS}), "
            f"{args.samples} samples of about {args.tokens} tokens per rank "
            f"({nbytes / 2**20:.0f} MiB of uint8 routes), packed into micro-batches of at most "
            f"{args.budget} tokens; medians of {args.repeats} runs. Timed: "
            "`trainer.layout.plan_step`, what the RL step calls (micro-batches, packing, the "
            "per-token tensors, records aligned to int16 per-router replay ids for this stage's "
            "routers, this rank's CP chunks and SP share; each router widens its ids to int64 "
            "on the device). Baseline: a plain copy "
            f"of the same route bytes in the same run, **{copy_ms:.1f} ms**.",
            "",
            "| layout (rank shown) | routers | micro-batches | plan_step ms | x copy "
            "| replay ids MiB (int16) |",
            "|---|---|---|---|---|---|",
            *rows,
            "",
            f"Machine: {platform.machine()}, {os.cpu_count()} cores, Python "
            f"{platform.python_version()}, numpy {np.__version__}, torch {torch.__version__}; "
            "one thread.",
        ]
    )
    print(markdown)
    if not args.dry_run:
        write_section("reshard", markdown, results)


if __name__ == "__main__":
    main()
