"""``routes``: look at routes in the route cache or in records files.

A SOURCE is a records file (``.npz`` / ``.pt``) or ``cache:HOST:PORT`` (then name the ids).

  routes inspect SOURCE [IDS...]             geometry, sizes, turns, per-layer expert load
  routes compare SOURCE OTHER [IDS...]       per-layer agreement of the samples in both
  routes export cache:HOST:PORT FILE IDS...  records from the cache into a file
  routes import FILE cache:HOST:PORT         records from a file into the cache
  routes plot SOURCE [IDS...] --out PNG [--against OTHER]
                                             expert load per layer (and agreement) as a figure
  routes size CONFIG --tokens T --samples-per-step N [--steps-ahead A]
      [--checkpoint-interval C] [--logprob-tokens G] [--maxmemory 2gb] [--masters M]
                                             route bytes per token, sample and step, and the
                                             Redis memory a run needs (CONFIG: a checkpoint
                                             folder or its config.json)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from routereplay.domain.record import Record
from routereplay.domain.record_file import load_records, save_records
from routereplay.domain.route_stats import agreement, expert_load, summarize_load
from routereplay.errors import RouteReplayError
from routereplay.rpc.client import RouteCacheClient
from routereplay.sizing import (
    MEMORY_BUDGET,
    Run,
    geometry_of,
    parse_memory,
    read_config,
    report,
    size_run,
)

CACHE = "cache:"


def load_source(source: str, ids: Sequence[str]) -> list[Record]:
    if source.startswith(CACHE):
        if not ids:
            raise SystemExit(f"routes: name the sample ids to read from {source}")
        with RouteCacheClient(source[len(CACHE) :]) as client:
            return list(client.read_batch(list(ids)))
    records = load_records(source)
    if ids:
        wanted = set(ids)
        records = [r for r in records if r.sample_id in wanted]
    return records


def inspect(records: list[Record]) -> str:
    lines = []
    for r in records:
        g = r.geometry
        versions = sorted({t.policy_version for t in r.turns})
        lines.append(
            f"{r.sample_id} group={r.group_id or '-'} model={g.model_id or '-'}: "
            f"{r.num_tokens} tokens, {r.num_rows} rows, {len(r.turns)} turn(s), policy "
            f"versions {versions}, MoE layers {list(g.moe_layers)}, top-{g.topk} of "
            f"{g.num_experts}, {r.routes.nbytes} route bytes ({g.dtype})"
        )
    if records:
        g = records[0].geometry
        load = sum(expert_load(r.routes, g.num_experts) for r in records)
        summary = summarize_load(load)
        lines.append(
            f"expert load per layer (balanced: share {1 / g.num_experts:.3f}, "
            f"entropy {np.log2(g.num_experts):.2f} bits)"
        )
        for layer, share, bits in zip(
            g.moe_layers, summary.max_share, summary.entropy_bits, strict=True
        ):
            lines.append(f"  layer {layer:3d}: busiest expert {share:.3f}, entropy {bits:.2f} bits")
    return "\n".join(lines)


def paired(a: list[Record], b: list[Record]) -> list[tuple[Record, Record]]:
    by_id = {r.sample_id: r for r in b}
    pairs = [(r, by_id[r.sample_id]) for r in a if r.sample_id in by_id]
    if not pairs:
        raise SystemExit("routes: the two sources share no sample id")
    for x, y in pairs:
        if x.geometry.moe_layers != y.geometry.moe_layers or x.geometry.topk != y.geometry.topk:
            raise SystemExit(f"routes: {x.sample_id} has different geometries in the two sources")
    return pairs


def compare(a: list[Record], b: list[Record]) -> str:
    pairs = paired(a, b)
    result = agreement([(x.routes, y.routes) for x, y in pairs])
    lines = [f"{len(pairs)} samples, {result.rows} rows compared (order within top-k ignored)"]
    for layer, exact, overlap in zip(
        pairs[0][0].geometry.moe_layers, result.exact, result.overlap, strict=True
    ):
        lines.append(f"  layer {layer:3d}: same top-k {exact:7.2%}   experts shared {overlap:7.2%}")
    return "\n".join(lines)


def plot(records: list[Record], out: Path, against: list[Record] | None) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    g = records[0].geometry
    load = sum(expert_load(r.routes, g.num_experts) for r in records)
    share = load / np.maximum(load.sum(axis=1, keepdims=True), 1)
    panels = 2 if against else 1
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
    image = axes[0, 0].imshow(share, aspect="auto", cmap="viridis")
    axes[0, 0].set(
        title="expert load share",
        xlabel="expert",
        ylabel="MoE layer",
        yticks=range(len(g.moe_layers)),
        yticklabels=g.moe_layers,
    )
    fig.colorbar(image, ax=axes[0, 0])
    if against:
        pairs = paired(records, against)
        result = agreement([(x.routes, y.routes) for x, y in pairs])
        x = np.arange(len(g.moe_layers))
        axes[0, 1].bar(x - 0.2, result.exact, 0.4, label="same top-k")
        axes[0, 1].bar(x + 0.2, result.overlap, 0.4, label="experts shared")
        axes[0, 1].set(
            title="agreement per layer",
            xlabel="MoE layer",
            ylim=(0, 1.05),
            xticks=x,
            xticklabels=g.moe_layers,
        )
        axes[0, 1].legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def _inspect(args) -> str:
    return inspect(load_source(args.source, args.ids))


def _compare(args) -> str:
    return compare(load_source(args.source, args.ids), load_source(args.other, args.ids))


def _export(args) -> str:
    records = load_source(args.source, args.ids)
    return f"wrote {len(records)} records to {save_records(args.file, records)}"


def _import(args) -> str:
    if not args.target.startswith(CACHE):
        raise SystemExit("routes: import into cache:HOST:PORT")
    records = load_records(args.file)
    with RouteCacheClient(args.target[len(CACHE) :]) as client:
        results = [client.write(r) for r in records]
    dup = sum(r.duplicate for r in results)
    return f"stored {len(results)} records ({dup} were already there)"


def _plot(args) -> str:
    records = load_source(args.source, args.ids)
    against = load_source(args.against, args.ids) if args.against else None
    return f"wrote {plot(records, args.out, against)}"


def _size(args) -> str:
    try:
        config, model_id = read_config(args.config)
        geometry = geometry_of(config, model_id, str(args.config))
        run = Run(
            args.tokens,
            args.samples_per_step,
            args.steps_ahead,
            args.checkpoint_interval,
            args.logprob_tokens,
        )
        maxmemory = parse_memory(args.maxmemory) if args.maxmemory else None
        if args.masters < 1 or not 0 < args.memory_budget <= 1:
            raise ValueError("--masters must be >= 1 and --memory-budget in (0, 1]")
    except ValueError as exc:
        raise SystemExit(f"routes size: {exc}") from exc
    return report(size_run(geometry, run), maxmemory, args.masters, args.memory_budget)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="routes", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("inspect")
    p.add_argument("source")
    p.add_argument("ids", nargs="*")
    p.set_defaults(run=_inspect)
    p = sub.add_parser("compare")
    p.add_argument("source")
    p.add_argument("other")
    p.add_argument("ids", nargs="*")
    p.set_defaults(run=_compare)
    p = sub.add_parser("export")
    p.add_argument("source")
    p.add_argument("file", type=Path)
    p.add_argument("ids", nargs="+")
    p.set_defaults(run=_export)
    p = sub.add_parser("import")
    p.add_argument("file", type=Path)
    p.add_argument("target")
    p.set_defaults(run=_import)
    p = sub.add_parser("plot")
    p.add_argument("source")
    p.add_argument("ids", nargs="*")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--against", default="")
    p.set_defaults(run=_plot)
    p = sub.add_parser("size", help="the Redis memory a run needs (docs/deployment.md)")
    p.add_argument("config", help="a checkpoint folder, or its config.json")
    p.add_argument("--tokens", type=int, required=True, help="tokens per sample")
    p.add_argument("--samples-per-step", type=int, required=True)
    p.add_argument("--steps-ahead", type=int, default=1, help="rollout steps ahead of training")
    p.add_argument("--checkpoint-interval", type=int, default=1, help="steps per checkpoint")
    p.add_argument(
        "--logprob-tokens", type=int, default=0, help="generated tokens with stored log-probs"
    )
    p.add_argument("--maxmemory", default="", help="a Redis maxmemory to check (e.g. 2gb)")
    p.add_argument("--masters", type=int, default=1, help="Redis Cluster masters (1: one Redis)")
    p.add_argument(
        "--memory-budget",
        type=float,
        default=MEMORY_BUDGET,
        help="the route cache's --memory-budget: the share of maxmemory routes may fill",
    )
    p.set_defaults(run=_size)
    args = parser.parse_args(argv)
    try:
        print(args.run(args))
    except RouteReplayError as exc:
        print(f"routes: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
