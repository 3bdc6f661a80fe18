"""The RL step in each trainer layout against one rank, and replay's cost in each.

``python -m trainer`` runs the same R3 and ``disabled`` steps on the same records (the model's
own float32 rollout from transformers) in each layout: one rank with padded micro-batches
(the baseline), one rank packed, 2 data-parallel ranks, TP2 + SP, 2 pipeline stages (1F1B),
2 pipeline stages packed. A step's time is its old-logprob and update passes (no comparison
pass), the median over the steps after the first; each layout runs ``disabled`` and R3 in
alternation, ``--repeats`` times, so the machine's drifts cancel. Replay overhead is R3
against ``disabled`` in the same layout. Processes are started once per run (megatron's import
and the build are outside the timed step).

Route bytes read (``--reads-only`` runs this part alone): the same R3 steps from a real route
cache (an in-process server over an embedded Redis), in layouts of 1 to 4 ranks, with stage
reads (each (DP rank, pipeline stage) reads its stage's layers once and broadcasts them to its
TP group) and with whole records read by every rank; the route bytes the route cache served,
by its own counter (``route_cache_route_bytes_served_total``), per step against the stored
route bytes of the step's batch. Target: at most 1.05x in every layout.

Usage: ``python -m benchmarks.performance.bench_layouts [--steps N] [--repeats N] [--quick]
[--no-write]
[--reads-only]``
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import machine, write_section
from benchmarks.performance.bench_trainer import SIZE_KW
from trainer.report.step_report import StepReport, reports_from_json

ROOT = Path(__file__).resolve().parents[2]
TP2SP = ["parallel.tp=2", "parallel.sequence_parallel=true"]
LAYOUTS = {  # name: (processes, overrides)
    "1 rank, padded": (1, []),
    "1 rank, packed": (1, ["train.packing=true"]),
    "DP2": (2, ["parallel.dp=2"]),
    "TP2+SP": (2, TP2SP),
    "PP2 (1F1B)": (2, ["parallel.pp=2"]),
    "PP2, packed": (2, ["parallel.pp=2", "train.packing=true"]),
}
QUICK = ("1 rank, padded", "PP2 (1F1B)")
READ_LAYOUTS = {  # name: (processes, overrides)
    "1 rank": (1, []),
    "DP2": (2, ["parallel.dp=2"]),
    "TP2+SP": (2, TP2SP),
    "PP2": (2, ["parallel.pp=2"]),
    "DP2 x PP2": (4, ["parallel.dp=2", "parallel.pp=2"]),
    "TP2+SP x PP2": (4, [*TP2SP, "parallel.pp=2"]),
}
READ_QUICK = ("TP2+SP", "TP2+SP x PP2")
READS = {"stage": [], "whole": ["data.stage_reads=false"]}


def trainer_reports(
    model_dir, source: str, out: Path, mode: str, ranks: int, extra, steps: int, ids: list[str] = ()
) -> list[StepReport]:
    """The step reports of one ``python -m trainer`` run; ``source``: where records come from
    (``data.records_file=...``, or ``route_cache.target=...`` with ``ids``)."""
    head = [sys.executable]
    if ranks > 1:
        head += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    report = out / f"{mode}.json"
    args = [
        "-m",
        "trainer",
        f"model.path={model_dir}",
        source,
        f"router_replay.mode={mode}",
        "train.batch_size=8",
        "train.micro_batch_size=4",
        "train.mini_batch_size=8",
        "train.ppo_epochs=1",
        "report.compare=false",
        "data.prefetch=false",
        *extra,
        *(["--ids", ",".join(ids)] if ids else []),
        "--steps",
        str(steps),
        "--report",
        str(report),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT))
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([*head, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{mode} {extra}: {proc.stderr[-3000:]}")
    return reports_from_json(json.loads(report.read_text()))


def run_trainer(model_dir, records, out: Path, mode: str, ranks: int, extra, steps: int):
    """Step times (s) of one ``python -m trainer`` run, the first step left out."""
    reports = trainer_reports(
        model_dir, f"data.records_file={records}", out, mode, ranks, extra, steps
    )
    return [r.time_s.old_logprob + r.time_s.update for r in reports[1:]]


def route_reads(model_dir, recs, tmp: Path, layouts: dict, steps: int = 2) -> dict:
    """Per layout and way of reading: route bytes the route cache served per step (its own
    counter) and their ratio to the stored route bytes of the step's batch (one copy of
    ``recs`` per step, RAW encoding: stored bytes = the routes' bytes)."""
    import dataclasses

    from route_cache.config import Config
    from route_cache.connection import connect
    from route_cache.embedded import start_embedded_redis
    from route_cache.server import RouteCacheServer
    from route_cache.store import RouteStore
    from routereplay.rpc.client import RouteCacheClient

    valkey, url = start_embedded_redis()
    client = connect(url, cluster=False)
    server = RouteCacheServer(
        Config(host="127.0.0.1", port=0, grace_s=1), RouteStore(client, ttl_ms=3_600_000)
    ).start()
    target = f"127.0.0.1:{server.port}"
    served = server.metrics.registry.get_sample_value
    ids = []
    out: dict = {"stored_per_step": sum(r.routes.nbytes for r in recs), "layouts": {}}
    try:
        with RouteCacheClient(target) as writer:
            for step in range(steps):
                for r in recs:
                    ids.append(f"reads-{step}-{r.sample_id}")
                    writer.write(dataclasses.replace(r, sample_id=ids[-1]))
        source = f"route_cache.target={target}"
        for name, (ranks, extra) in layouts.items():
            row = out["layouts"][name] = {}
            for reads, how in READS.items():
                folder = tmp / f"reads-{ranks}-{len(out['layouts'])}-{reads}"
                folder.mkdir()
                before = served("route_cache_route_bytes_served_total") or 0.0
                reports = trainer_reports(
                    model_dir, source, folder, "R3", ranks, [*extra, *how], steps, ids
                )
                total = served("route_cache_route_bytes_served_total") - before
                # The trainer's own count of what it read agrees with the route cache's.
                assert sum(r.route_bytes.read for r in reports) == total, (name, reads)
                row[reads] = total / steps
                row[f"{reads}_ratio"] = total / (steps * out["stored_per_step"])
                print(f"{name:14s} {reads:5s} reads {row[f'{reads}_ratio']:.3f}x", flush=True)
    finally:
        server.stop(0)
        client.close()
        valkey.stop()
    return out


def reads_section(model_dir, recs, tmp: Path, quick: bool) -> tuple[str, dict]:
    layouts = {k: v for k, v in READ_LAYOUTS.items() if not quick or k in READ_QUICK}
    results = route_reads(model_dir, recs, tmp, layouts)
    results["machine"] = machine()
    stored = results["stored_per_step"]
    rows = "\n".join(
        f"| {k} | {READ_LAYOUTS[k][0]} | {row['stage'] / 2**10:.1f} | "
        f"**{row['stage_ratio']:.2f}x** | {row['whole'] / 2**10:.1f} | {row['whole_ratio']:.2f}x |"
        for k, row in results["layouts"].items()
    )
    markdown = f"""## Trainer layouts: route bytes read per step against the bytes stored

`python -m benchmarks.performance.bench_layouts --reads-only` ({results["machine"]}). The layouts'
R3 steps
from a real route cache (in-process server, embedded Redis): 8 records per step, the same
model and records as above, {stored / 2**10:.1f} KiB of stored routes per step (RAW: the
routes' own bytes), 2 steps per run. Counted by the route cache itself
(`route_cache_route_bytes_served_total`); the trainer's own count (`route_bytes.read` in its
report) agrees in every run. **Stage reads**: one rank per (DP rank, pipeline stage) reads its
stage's MoE layers and broadcasts them to its TP/CP group (the default); **whole reads**:
every rank reads whole records (`data.stage_reads=false`). Target: at most 1.05x.

| layout | processes | stage reads: KiB per step | / stored | whole reads: KiB per step | / stored |
|---|---|---|---|---|---|
{rows}

Whole reads cost TP x PP x CP times the stored bytes (the read fan-out of
`benchmarks/performance/scaling_model.py`); stage reads 1x in every layout.
"""
    return markdown, results


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="2 layouts, 3 steps, 1 repeat")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument("--reads-only", action="store_true", help="only the route bytes read")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 3, 1
    layouts = (
        {}
        if args.reads_only
        else {k: v for k, v in LAYOUTS.items() if not args.quick or k in QUICK}
    )

    from routereplay.dev.hf_rollout import random_prompts, rollout_records
    from routereplay.dev.tiny_model import MoESize, build_tiny_model
    from routereplay.domain.record_file import save_records

    times: dict[str, dict[str, list[float]]] = {k: {"disabled": [], "R3": []} for k in layouts}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(f"{tmp}/model", seed=0, size=MoESize(**SIZE_KW))
        prompts = random_prompts(2, [48, 96], 512, seed=3)
        recs = rollout_records(model_dir, prompts, group_size=4, new_tokens=64, seed=0)
        records = save_records(f"{tmp}/rollout.npz", recs)
        tokens = int(sum(r.token_ids.size for r in recs))
        for repeat in range(args.repeats):
            for name, (ranks, extra) in layouts.items():
                # Alternate which mode runs first, so slow drifts of the machine cancel.
                modes = ("disabled", "R3") if repeat % 2 == 0 else ("R3", "disabled")
                for mode in modes:
                    out = Path(tmp) / f"{repeat}-{len(times[name][mode])}-{ranks}"
                    out.mkdir(exist_ok=True)
                    got = run_trainer(model_dir, records, out, mode, ranks, extra, args.steps)
                    times[name][mode].extend(got)
                    print(f"{name:16s} {mode:8s} {statistics.median(got):.4f} s", flush=True)
        reads_markdown, reads = reads_section(model_dir, recs, Path(tmp), args.quick)
    print(reads_markdown)
    if not args.no_write:
        write_section("layout_reads", reads_markdown, reads)
    if args.reads_only:
        return reads
    med = {k: {m: statistics.median(v) for m, v in t.items()} for k, t in times.items()}
    base = med["1 rank, padded"]
    results = {
        "model": "Qwen3-MoE, 8 layers (layer 0 dense), hidden 256, 32 experts top-4",
        "samples": 8,
        "tokens": tokens,
        "steps": args.steps,
        "repeats": args.repeats,
        "median_step_s": med,
        "vs_one_rank": {k: m["R3"] / base["R3"] for k, m in med.items()},
        "replay_overhead": {k: m["R3"] / m["disabled"] - 1 for k, m in med.items()},
        "machine": machine(),
    }
    rows = "\n".join(
        f"| {k} | {LAYOUTS[k][0]} | {m['disabled']:.3f} | {m['R3']:.3f} | "
        f"{results['vs_one_rank'][k]:.2f}x | {results['replay_overhead'][k] * 100:+.1f}% |"
        for k, m in med.items()
    )
    markdown = f"""## Trainer layouts: the RL step against one rank, replay's cost in each

`python -m benchmarks.performance.bench_layouts` ({results["machine"]}; every process 1 thread, so a
2-process layout has a core per rank). Model: {results["model"]}, float32; 8 samples
({tokens} tokens: 2 prompts of 48 and 96 tokens, 4 samples each of 64 generated tokens) per
step as 2 micro-batches of 4, one optimizer step, one PPO epoch, no comparison pass; a step is
the old-logprob pass and the update pass through megatron's schedule. Medians over
{args.steps - 1} steps (the first left out) x {args.repeats} runs per mode, the modes
alternating.

| layout | processes | disabled (s) | R3 (s) | R3 vs 1 rank | replay overhead (R3 / disabled) |
|---|---|---|---|---|---|
{rows}

Replay overhead target: at most 2%. On this shared 2-core machine differences of a few percent
between runs of the same mode are common: read the overheads as noise unless they repeat.
"""
    print(markdown)
    if not args.no_write:
        write_section("layouts", markdown, results)
    return results


if __name__ == "__main__":
    main()
