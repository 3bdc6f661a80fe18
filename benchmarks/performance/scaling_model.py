"""From the measured figures to a fleet: route bytes/s, route cache replicas, Redis shards and
a trainer rank's memory for its share of the routes.

Inputs are the figures the route cache benchmark measured on this machine (read from its
results JSON; the defaults below where it has not run) and the fleet's parameters. Every
figure is arithmetic on those, nothing is measured here:

- route bytes/s = rollout GPUs x tokens/s per GPU x bytes per token (uint8: MoE layers x top-k);
- the trainer reads what the fleet writes, in one of two layouts, each with its read fan-out
  (route bytes read per route byte written):
  - stage reads (the trainer's default, ``trainer/data/stage_reads.py``): one rank per
    (data-parallel rank, pipeline stage) reads its stage's MoE layers (a layer-selected
    ReadBatch) and broadcasts them to its tensor- and context-parallel group. Fan-out: the
    stages' layers add up to the record, so 1x in bytes, in PP calls per record; measured by
    ``bench_layouts`` (the route cache's own byte counter against the stored bytes, the
    largest ratio over its layouts), read from its ``layout_reads.json`` where it has run;
  - whole reads by every rank (before layer selection): every rank of a data-parallel group
    fetches the group's whole records. Fan-out: TP x PP x CP;
- route cache replicas = headroom x (write bytes/s / measured write throughput of one process
  + read bytes/s / measured batch-read throughput of one process), rounded up; stage reads
  count at the measured throughput of the benchmark's layer-selected read;
- Redis shards = the same with raw redis-py throughput against one server as one shard's
  capacity (an upper bound: one client, loopback, no replication);
- a fetching trainer rank holds its data-parallel share of a step's records as fetched (uint8,
  its stage's MoE layers), then its local rows (its CP chunk and SP share, its stage's layers)
  as int16 (the trainer's replay ids on the host, ``replay_dtype``) and megatron's per-router
  int64 tensors (on the device).

Usage: python -m benchmarks.performance.scaling_model [--tokens-per-s N] [--rollout-gpus 64] [...]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import benchmarks.common as common  # run_all points RESULTS elsewhere
from routereplay.dev.synthetic import DEEPSEEK_V3, QWEN3_30B_A3B
from routereplay.domain.record import Geometry

MIB = 2**20
GIB = 2**30


@dataclass(frozen=True)
class Model:
    """A served model: its routing geometry and an assumed generation rate per rollout GPU."""

    geometry: Geometry
    tokens_per_s: float  # record tokens per second per rollout GPU: an ASSUMPTION
    source: str  # where the assumption comes from


MODELS = (
    Model(
        QWEN3_30B_A3B,
        5000.0,
        "an order of magnitude for vLLM decoding a 3B-active MoE on "
        "one H100 at a large batch; not from a published benchmark",
    ),
    Model(
        DEEPSEEK_V3,
        1850.0,
        "from DeepSeek's published serving figures: about 14.8k output "
        "tokens/s per 8-GPU H800 node while decoding",
    ),
)


@dataclass(frozen=True)
class Fleet:
    """The deployment. Defaults: 64 rollout GPUs, 256 trainer GPUs, 32K-token samples; the
    global batch, the trainer layout and the headroom are assumptions."""

    rollout_gpus: int = 64
    trainer_gpus: int = 256
    sample_tokens: int = 32768
    global_batch: int = 1024  # samples per training step
    tp: int = 4  # tensor parallel, with sequence parallelism
    pp: int = 4
    cp: int = 1
    headroom: float = 2.0  # plan for this many times the steady load


@dataclass(frozen=True)
class Measured:
    """Throughput of one process, MiB/s of route bytes."""

    cache_write: float
    cache_read: float
    redis_write: float
    redis_read: float
    source: str
    cache_stage_read: float = 0.0  # a layer-selected read, MiB/s of the bytes it reads (0: as
    # cache_read, for results of before the benchmark measured it)
    stage_fanout: float = 1.0  # route bytes served per byte stored with the trainer's stage
    # reads, the largest over bench_layouts' layouts (1.0, the design's, where it has not run)
    fanout_source: str = "the design's value: bench_layouts.py has not run in this checkout"

    @property
    def stage_read(self) -> float:
        return self.cache_stage_read or self.cache_read


# The route cache benchmark's medians at 32K tokens on the development machine: used only
# where results/route_cache.json is absent.
DEFAULT_MEASURED = Measured(150.0, 160.0, 1500.0, 400.0, "defaults (no route_cache results)")


def load_measured(results: Path) -> Measured:
    """Medians of the route cache benchmark's rows (its 32K-token rows where it has them), and
    the trainer's stage-read fan-out from the layouts benchmark where it has run."""
    measured = _route_cache_measured(results)
    path = results / "layout_reads.json"
    if not path.exists():
        return measured
    layouts = json.loads(path.read_text())["layouts"]
    return replace(
        measured,
        stage_fanout=max(row["stage_ratio"] for row in layouts.values()),
        fanout_source=f"{path.name}, the largest over {len(layouts)} trainer layouts",
    )


def _route_cache_measured(results: Path) -> Measured:
    path = results / "route_cache.json"
    if not path.exists():
        return DEFAULT_MEASURED
    rows = json.loads(path.read_text())["results"]
    rows = [r for r in rows if r["tokens"] >= 32768] or rows

    def med(key: str) -> float:
        return statistics.median(r[key] for r in rows)

    stage = "service_raw_stage_read_mibs"
    return Measured(
        med("service_raw_write_mibs"),
        med("service_raw_read_mibs"),
        med("redis_write_mibs"),
        med("redis_read_mibs"),
        f"{path.name}, median of {len(rows)} rows of {rows[0]['tokens']} tokens",
        med(stage) if all(stage in r for r in rows) else 0.0,
    )


def scale(model: Model, fleet: Fleet, measured: Measured) -> dict:
    """Every figure of the model for one served model (bytes, seconds, counts)."""
    g = model.geometry
    bytes_per_token = g.row_bytes
    tokens_s = fleet.rollout_gpus * model.tokens_per_s
    write_bps = tokens_s * bytes_per_token
    model_parallel = fleet.tp * fleet.pp * fleet.cp  # ranks of one data-parallel group
    # Stage reads: stage s reads its layers once per DP rank; the stages' layers partition the
    # MoE layers (megatron's uneven split too), so the bytes read add up to the record.
    stage_layers = math.ceil(g.num_moe_layers / fleet.pp)  # the largest stage's
    fanout = measured.stage_fanout
    read_bps = write_bps * fanout
    fanout_whole = model_parallel  # whole records by every rank
    read_bps_whole = write_bps * fanout_whole
    record_bytes = fleet.sample_tokens * bytes_per_token
    dp = fleet.trainer_gpus // model_parallel
    rank_samples = math.ceil(fleet.global_batch / dp)
    local_tokens = rank_samples * fleet.sample_tokens / fleet.cp / fleet.tp
    local_routes = local_tokens * stage_layers * g.topk

    def replicas(write: float, read: float, reads: float) -> int:
        """Processes of ``write``/``read`` MiB/s for the writes and ``reads`` bytes/s read."""
        return math.ceil(fleet.headroom * (write_bps / (write * MIB) + reads / (read * MIB)))

    fetched = rank_samples * fleet.sample_tokens * stage_layers * g.topk * g.dtype.itemsize
    return {
        "model": g.model_id,
        "bytes_per_token": bytes_per_token,
        "fleet_tokens_per_s": tokens_s,
        "write_bytes_per_s": write_bps,
        "fetch_fanout": fanout,
        "fetch_calls_per_record": fleet.pp,
        "read_bytes_per_s": read_bps,
        "fetch_fanout_whole": fanout_whole,
        "read_bytes_per_s_whole": read_bps_whole,
        "record_bytes": record_bytes,
        "samples_per_s": tokens_s / fleet.sample_tokens,
        "step_s": fleet.global_batch * fleet.sample_tokens / tokens_s,
        "cache_replicas": replicas(measured.cache_write, measured.stage_read, read_bps),
        "redis_shards": replicas(measured.redis_write, measured.redis_read, read_bps),
        "cache_replicas_whole": replicas(measured.cache_write, measured.cache_read, read_bps_whole),
        "redis_shards_whole": replicas(measured.redis_write, measured.redis_read, read_bps_whole),
        "dp": dp,
        "rank_samples": rank_samples,
        "stage_layers": stage_layers,
        "rank_fetched_bytes": fetched,
        "rank_int16_bytes": 2 * local_routes,
        "rank_int64_bytes": 8 * local_routes,
        "rank_fetch_s": fetched / (measured.stage_read * MIB),
    }


def markdown(rows: list[dict], fleet: Fleet, measured: Measured, models) -> str:
    m = measured
    lines = [
        "## Scaling model: from these figures to a fleet",
        "",
        "`python -m benchmarks.performance.scaling_model` (arithmetic, nothing measured): the "
        "measured "
        f"throughput of one process ({m.source}): route cache write {m.cache_write:.0f}, "
        f"batch read {m.cache_read:.0f} and layer-selected batch read {m.stage_read:.0f} "
        f"MiB/s, raw redis-py SET {m.redis_write:.0f} and GET "
        f"{m.redis_read:.0f} MiB/s (one shard's capacity, an upper bound). Fleet: "
        f"{fleet.rollout_gpus} rollout GPUs, {fleet.trainer_gpus} trainer GPUs (TP"
        f"{fleet.tp}+SP, PP{fleet.pp}, CP{fleet.cp}), samples of {fleet.sample_tokens} tokens, "
        f"{fleet.global_batch} samples per step, capacity planned at {fleet.headroom:g}x the "
        "steady load. Read fan-out (bytes read per byte written) by layout: **stage reads** "
        "(the trainer's default: one rank per (DP rank, PP stage) reads its stage's layers "
        f"and broadcasts them to its TP/CP group): {m.stage_fanout:.2f}x ({m.fanout_source}), "
        "in PP calls per record; **whole reads by every rank** (`data.stage_reads=false`): "
        "TP x PP x CP.",
        "",
        "Assumed tokens/s per rollout GPU (**assumptions**, not measured here):",
        "",
        *[f"- {x.geometry.model_id}: {x.tokens_per_s:,.0f} ({x.source})." for x in models],
        "",
        "| | " + " | ".join(r["model"] for r in rows) + " |",
        "|---" * (len(rows) + 1) + "|",
    ]
    table = [
        ("route bytes per token (uint8)", lambda r: f"{r['bytes_per_token']}"),
        ("one record of a sample", lambda r: f"{r['record_bytes'] / MIB:.1f} MiB"),
        ("fleet tokens/s", lambda r: f"{r['fleet_tokens_per_s']:,.0f}"),
        ("**route bytes/s written**", lambda r: f"**{r['write_bytes_per_s'] / MIB:,.0f} MiB/s**"),
        (
            "route bytes/s read, stage reads (x fan-out; calls per record)",
            lambda r: (
                f"{r['read_bytes_per_s'] / MIB:,.0f} MiB/s (x{r['fetch_fanout']:.2f}; "
                f"{r['fetch_calls_per_record']})"
            ),
        ),
        (
            "route bytes/s read, whole reads by every rank (x fan-out)",
            lambda r: (
                f"{r['read_bytes_per_s_whole'] / MIB:,.0f} MiB/s (x{r['fetch_fanout_whole']})"
            ),
        ),
        ("samples/s; seconds per step", lambda r: f"{r['samples_per_s']:.1f}; {r['step_s']:.0f} s"),
        ("**route cache replicas** (stage reads)", lambda r: f"**{r['cache_replicas']}**"),
        ("**Redis Cluster shards** (stage reads)", lambda r: f"**{r['redis_shards']}**"),
        (
            "replicas; shards with whole reads by every rank",
            lambda r: f"{r['cache_replicas_whole']}; {r['redis_shards_whole']}",
        ),
        (
            "trainer: DP ranks; samples per DP rank and step",
            lambda r: f"{r['dp']}; {r['rank_samples']}",
        ),
        (
            "**a fetching rank's records as fetched (uint8, its stage's layers)**",
            lambda r: f"**{r['rank_fetched_bytes'] / GIB:.2f} GiB** ({r['stage_layers']} layers)",
        ),
        (
            "its local routes as int16 replay ids; as int64 router tensors",
            lambda r: f"{r['rank_int16_bytes'] / GIB:.2f}; {r['rank_int64_bytes'] / GIB:.2f} GiB",
        ),
        (
            "fetching them at one process's layer-selected read rate",
            lambda r: f"{r['rank_fetch_s']:.1f} s",
        ),
    ]
    lines += [f"| {name} | " + " | ".join(cell(r) for r in rows) + " |" for name, cell in table]
    lines += [
        "",
        f"With whole reads by every rank, reads are {rows[0]['fetch_fanout_whole']}x the "
        "writes; stage reads (each stage's layers once per data-parallel rank) bring them to "
        f"{m.stage_fanout:.2f}x and the route cache replicas from "
        + " and ".join(f"{r['cache_replicas_whole']} to {r['cache_replicas']}" for r in rows)
        + ", the Redis shards from "
        + " and ".join(f"{r['redis_shards_whole']} to {r['redis_shards']}" for r in rows)
        + ".",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for f in fields(Fleet):
        parser.add_argument(
            f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default
        )
    parser.add_argument(
        "--tokens-per-s",
        type=float,
        nargs=2,
        metavar=("QWEN3", "DSV3"),
        help="override the assumed tokens/s per rollout GPU",
    )
    parser.add_argument(
        "--results",
        type=Path,
        default=None,
        help="folder of the benchmarks' JSON (default: results/)",
    )
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    fleet = Fleet(**{f.name: getattr(args, f.name) for f in fields(Fleet)})
    models = MODELS
    if args.tokens_per_s:
        models = tuple(
            replace(m, tokens_per_s=t, source="given on the command line")
            for m, t in zip(MODELS, args.tokens_per_s, strict=True)
        )
    measured = load_measured(args.results or common.RESULTS)
    rows = [scale(m, fleet, measured) for m in models]
    text = markdown(rows, fleet, measured, models)
    print(text)
    results = {"fleet": asdict(fleet), "measured": asdict(measured), "models": rows}
    if not args.no_write:
        common.write_section("scaling", text, results)
    return results


if __name__ == "__main__":
    main()
