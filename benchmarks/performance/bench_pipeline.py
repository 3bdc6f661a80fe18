"""End to end, per batch: rollout (vLLM on the CPU) -> route cache -> trainer fetch + reshard.

Each repeat is one RL batch through the real parts: a GenerateBatch streamed from the rollout
server (the tiny Qwen3-MoE on vLLM's CPU build, routes captured and written as records), the
route cache in its own process over a Redis-compatible server, and what a trainer rank does
before its step: one ``read_batch`` of the batch's records (``trainer.data.source.CacheSource``) and
laying them out as its step does (``trainer.layout.plan_step``: packed micro-batches and
per-router replay ids). Stages per batch:

- generate: the request until the batch's last token reached the client;
- store: from then until the last record was acknowledged by the route cache (its final
  message is sent only then); writes of earlier samples overlap generation and are not here;
- fetch: one ``read_batch`` of the batch's records;
- reshard: ``plan_step`` on the batch (TP1: the whole batch; micro-batches under the token
  budget, packed, every record aligned to int16 replay ids).

Two baselines, same run: the same capture-on engine behind a second server that stores
nothing, its batches interleaved with the measured ones (what moving the routes costs, free of
the machine's drift); and, a second engine loaded afterwards (skipped by ``--quick``, which
loads one engine), the engine alone with capture off (vLLM's
``enable_return_routed_experts=False``): capture and moving together, but not interleaved.

Usage: python -m benchmarks.performance.bench_pipeline [--quick] [--size bench|tiny] [--prompts 8
--n 4]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.common import machine, write_section
from benchmarks.performance.bench_rollout import prompts, start_engine
from rollout_server.config import Config
from rollout_server.engine import VLLMEngine
from rollout_server.server import RolloutServer
from routereplay.dev.launch import start_service, stop_process
from routereplay.dev.tiny_model import BENCH_SIZE, build_tiny_model
from routereplay.domain.rollout import SampleDelta, SampleDone, SampleFailed, SamplingOptions
from routereplay.families.base import TINY_SIZE
from routereplay.rpc.rollout_client import AsyncRolloutClient
from trainer.config import TrainConfig
from trainer.data.source import CacheSource, Sample
from trainer.distributed.dp import DataParallel
from trainer.layout import RankShare, plan_step

MIB = 2**20
STAGE_NAMES = {
    "generate": "generate (request -> last token)",
    "store": "store (last token -> last record acknowledged)",
    "fetch": "fetch (one read_batch)",
    "reshard": "reshard (plan_step: micro-batches, packed, replay ids, TP1)",
}
STAGES = tuple(STAGE_NAMES)


async def generate(client: AsyncRolloutClient, args) -> dict:
    """One GenerateBatch: generate and store seconds, stored sample ids, generated tokens."""
    options = SamplingOptions(temperature=0.0, max_tokens=args.max_tokens)
    ids, tokens = [], 0
    t0 = last_token = time.perf_counter()
    async for event in client.generate_batch(prompts(args.prompts), args.n, options):
        if isinstance(event, SampleDelta):
            last_token = time.perf_counter()
        elif isinstance(event, SampleDone):
            tokens += event.generated_tokens
            if event.stored:
                ids.append(event.sample_id)
        elif isinstance(event, SampleFailed):
            raise RuntimeError(f"{event.sample_id} failed: {event.message}")
    end = time.perf_counter()
    return {"generate": last_token - t0, "store": end - last_token, "ids": ids, "tokens": tokens}


def fetch_and_reshard(source: CacheSource, ids: list[str], budget: int) -> dict:
    """What a trainer rank does with a batch before its step: fetch, then reshard (TP1)."""
    t0 = time.perf_counter()
    records = source.fetch(ids)
    t1 = time.perf_counter()
    routes = [r.routes for r in records]
    lengths = [r.num_tokens for r in records]
    geometry = records[0].geometry
    train = TrainConfig(
        batch_size=len(ids),
        micro_batch_size=len(ids),
        max_tokens_per_micro_batch=budget,
        packing=True,
    )
    laid = plan_step(
        [Sample.from_record(r) for r in records],
        records,
        np.zeros(len(ids), np.float32),
        train=train,
        dp=DataParallel(),
        share=RankShare(None),
        geometry=geometry,
        router_layers=geometry.moe_layers,
    )
    local_bytes = sum(t.numel() * t.element_size() for mb in laid.replay_ids for t in mb)
    t2 = time.perf_counter()
    return {
        "fetch": t1 - t0,
        "reshard": t2 - t1,
        "route_bytes": sum(r.nbytes for r in routes),
        "record_tokens": sum(lengths),
        "local_bytes": local_bytes,
    }


async def run_batches(engine: VLLMEngine, cache: str, stores: tuple[bool, ...], args):
    """``args.repeats`` batches after a warm-up through one server per entry of ``stores``
    (True: records written, then fetched and resharded; False: nothing stored), the servers
    taking turns batch by batch. Returns per server the stages of each batch."""
    servers = []
    for store in stores:
        config = Config(
            host="127.0.0.1",
            port=0,
            route_cache=cache,
            capture_routes=store,
            max_n=args.n,
            grace_s=5,
        )
        servers.append(await RolloutServer(config, engine).start())
    clients = [AsyncRolloutClient(f"127.0.0.1:{server.port}") for server in servers]
    source = CacheSource(cache)
    runs: list[list[dict]] = [[] for _ in stores]
    try:
        for i in range(args.repeats + 1):  # the first is a warm-up
            turns = list(range(len(stores)))
            for k in turns if i % 2 else turns[::-1]:  # who goes first alternates
                batch = await generate(clients[k], args)
                ids = batch.pop("ids")
                if stores[k]:
                    assert len(ids) == args.prompts * args.n, "records were not stored"
                    batch |= fetch_and_reshard(source, ids, args.budget)
                else:
                    assert not ids, "a baseline run stored records"
                if i:
                    runs[k].append(batch)
    finally:
        source.close()
        for client, server in zip(clients, servers, strict=True):
            await client.close()
            await server.stop(5)
    return runs


async def bench(model: Path, cache: str, args) -> dict[str, list[dict]]:
    """Per run ("on", "store_off", and unless quick "capture_off") its batches; one engine
    at a time."""
    engine = start_engine(model, True, args)
    try:
        on, store_off = await run_batches(engine, cache, (True, False), args)
    finally:
        engine.shutdown()
    runs = {"on": on, "store_off": store_off}
    if not args.quick:
        engine = start_engine(model, False, args)
        try:
            (runs["capture_off"],) = await run_batches(engine, cache, (False,), args)
        finally:
            engine.shutdown()
    return runs


def summarize(on: list[dict], off: list[dict]) -> dict:
    """Medians per stage; route bytes/s per stage; the share of time moving routes."""
    med = {s: statistics.median(r.get(s, 0.0) for r in on) for s in STAGES}
    total_on = statistics.median(sum(r.get(s, 0.0) for s in STAGES) for r in on)
    total_off = statistics.median(r["generate"] + r["store"] for r in off)
    route_bytes = on[0]["route_bytes"]  # greedy: the same tokens every batch
    moving = med["store"] + med["fetch"] + med["reshard"]
    return {
        "stage_s_median": med,
        "end_to_end_s_median": total_on,
        "baseline_s_median": total_off,
        "route_bytes_per_batch": route_bytes,
        "route_mibs": {s: route_bytes / med[s] / MIB for s in ("store", "fetch", "reshard")},
        "tokens_per_batch": on[0]["tokens"],
        "record_tokens_per_batch": on[0]["record_tokens"],
        "end_to_end_route_mibs": route_bytes / total_on / MIB,
        "route_moving_share": moving / total_on,
        "overhead_vs_baseline": total_on / total_off - 1,
    }


def spread(runs: list[dict]) -> str:
    """The range of generate times, "min-max"."""
    times = [r["generate"] for r in runs]
    return f"{min(times):.2f}-{max(times):.2f}"


BASELINES = {
    "store_off": "same engine, a server storing nothing, interleaved",
    "capture_off": "engine alone, capture off, loaded afterwards",
}


def markdown(results: dict, args) -> str:
    runs, summary = results["runs"], results["summary"]
    s = summary["store_off"]
    med, mibs, total = s["stage_s_median"], s["route_mibs"], s["end_to_end_s_median"]
    size = results["size"]
    rows = "\n".join(
        f"| {name} | {1000 * med[key]:.1f} | {100 * med[key] / total:.1f}% "
        f"| {f'{mibs[key]:.1f}' if key in mibs else '-'} |"
        for key, name in STAGE_NAMES.items()
    )
    baselines = "\n".join(
        f"| baseline: {BASELINES[b]} | {1000 * summary[b]['baseline_s_median']:.1f} "
        f"| **{100 * summary[b]['overhead_vs_baseline']:+.1f}%** | - |"
        for b in BASELINES
        if b in summary
    )
    spreads = "; ".join(
        f"{BASELINES.get(k, 'capture on, storing')} {spread(v)} s" for k, v in runs.items()
    )
    capture_off_note = (
        " The capture-off engine adds capture inside the engine, but runs after the others and"
        " so carries the machine's drift."
        if "capture_off" in summary
        else ""
    )
    return f"""## End to end: rollout -> route cache -> trainer fetch + reshard

`python -m benchmarks.performance.bench_pipeline{" --quick" if args.quick else ""}`: {args.prompts} prompts x {args.n} samples of {args.max_tokens} tokens per batch ({s["tokens_per_batch"]} generated tokens; {s["route_bytes_per_batch"] / 1024:.0f} KiB of routes for {s["record_tokens_per_batch"]} record tokens); medians over {args.repeats} batches after a warm-up.
Model: generated Qwen3-MoE, {size["num_hidden_layers"]} layers (layer 0 dense), hidden {size["hidden_size"]}, top-{size["num_experts_per_tok"]} of {size["num_experts"]} experts, float32. The rollout server (vLLM CPU build) and the trainer's fetch + reshard run in one process, the route cache in its own over a Redis-compatible server.
Machine: {results["machine"]}.

| stage per batch | ms (median) | of end to end (or against it) | route MiB/s |
|---|---|---|---|
{rows}
| **end to end** | {1000 * total:.1f} | 100% | {s["end_to_end_route_mibs"]:.2f} |
{baselines}

Time in the route stages (store + fetch + reshard): **{100 * s["route_moving_share"]:.1f}%** of end to end. Against the interleaved baseline the rest of the difference is in generate: finished samples' records are validated and written while the others still generate, on the same cores.{capture_off_note} Generate per batch, min-max: {spreads}.
This model's routes are small ({s["route_bytes_per_batch"] / s["record_tokens_per_batch"]:.0f} B per token against 384 for Qwen3-30B-A3B) and a CPU generates few tokens/s, so per-call costs dominate the route stages' MiB/s here; the route cache section measures throughput at full size, and the scaling model below carries both to a fleet.
"""  # noqa: E501


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--size", choices=["bench", "tiny"], default="bench")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--budget", type=int, default=4096, help="tokens per micro-batch")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="tiny, 2 x 2 samples of 16 tokens, 2 repeats, one engine",
    )
    args = parser.parse_args()
    if args.quick:
        args.size, args.prompts, args.n, args.max_tokens, args.repeats = "tiny", 2, 2, 16, 2

    import torch

    torch.set_num_threads(1)  # this process streams, fetches and reshards; vLLM has its own
    size = BENCH_SIZE if args.size == "bench" else TINY_SIZE
    with tempfile.TemporaryDirectory(prefix="bench-pipeline-") as work:
        model = build_tiny_model(Path(work) / "model", seed=0, size=size)
        cache_proc, cache = start_service("route_cache", "--ttl-s", "600", quiet=True)
        try:
            runs = asyncio.run(bench(model, cache, args))
        finally:
            stop_process(cache_proc)
    on = runs["on"]
    for name, batches in runs.items():
        assert batches[0]["tokens"] == on[0]["tokens"], f"{name} generated different tokens"
    for r in on:
        assert r["local_bytes"] >= r["route_bytes"], "reshard lost rows"
    results = {
        "machine": machine(),
        "size": dataclasses.asdict(size),
        "workload": vars(args),
        "runs": runs,
        "summary": {name: summarize(on, runs[name]) for name in BASELINES if name in runs},
    }
    text = markdown(results, args)
    print(text)
    write_section("pipeline", text, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
