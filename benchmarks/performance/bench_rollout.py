"""Rollout server benchmark: what routed-expert capture and record writes cost.

Two runs of the same server code on the same model and prompts, one engine after the other:
capture on (routes captured, validated, written to a real route cache over Redis) and capture
off (vLLM's ``enable_return_routed_experts=False``, nothing stored). Each run streams the
same GenerateBatch over gRPC ``--repeats`` times; the figures are medians. Greedy decoding
on the same weights generates the same tokens in both runs, so tokens/s compare like for like.

Also measured with capture on: the time from a sample's last token (its last delta reaching
the client) to its final message, which is sent only after the route cache acknowledged the
record, i.e. when the record is readable.

Usage::

    python -m benchmarks.performance.bench_rollout [--size bench|tiny] [--prompts 8 --n 4
    --max-tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

from rollout_server.config import Config
from rollout_server.engine import VLLMEngine
from rollout_server.server import RolloutServer
from route_cache.config import Config as CacheConfig
from route_cache.connection import connect
from route_cache.embedded import start_embedded_redis
from route_cache.server import RouteCacheServer
from route_cache.store import RouteStore
from routereplay.dev.tiny_model import BENCH_SIZE, build_tiny_model
from routereplay.domain.rollout import SampleDelta, SampleDone, SamplingOptions
from routereplay.families.base import TINY_SIZE
from routereplay.rpc.rollout_client import AsyncRolloutClient

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "A mixture of experts model routes each token to a few experts out of many.",
    "Reinforcement learning samples rollouts from an inference engine.",
    "Router replay records the experts that the engine chose.",
    "Once upon a time there was a small model that lived on a laptop.",
]


def prompts(count: int) -> list[str]:
    """``count`` different prompts of about 40 tokens."""
    n = len(SENTENCES)
    return [" ".join(SENTENCES[(i + j) % n] for j in range(3)) + f" ({i})" for i in range(count)]


async def one_batch(client: AsyncRolloutClient, args) -> dict:
    """One GenerateBatch; returns generated tokens, wall seconds, last-token-to-stored delays."""
    options = SamplingOptions(temperature=0.0, max_tokens=args.max_tokens)
    last_token: dict[str, float] = {}
    delays, tokens, stored = [], 0, 0
    t0 = time.perf_counter()
    async for event in client.generate_batch(prompts(args.prompts), args.n, options):
        now = time.perf_counter()
        if isinstance(event, SampleDelta):
            last_token[event.sample_id] = now
        elif isinstance(event, SampleDone):
            tokens += event.generated_tokens
            stored += event.stored
            delays.append(now - last_token[event.sample_id])
    return {
        "tokens": tokens,
        "seconds": time.perf_counter() - t0,
        "stored": stored,
        "delays": delays,
    }


def start_engine(model: Path, capture: bool, args) -> VLLMEngine:
    """The benchmarks' engine: one batch of ``prompts x n`` samples at once."""
    return VLLMEngine(
        model,
        capture_routes=capture,
        max_model_len=1024,
        max_num_seqs=args.prompts * args.n,
        enable_prefix_caching=True,
        seed=0,
    )


async def run_mode(model: Path, cache_target: str, capture: bool, args) -> dict:
    engine = start_engine(model, capture, args)
    config = Config(
        host="127.0.0.1",
        port=0,
        route_cache=cache_target,
        capture_routes=capture,
        max_n=args.n,
        grace_s=5,
    )
    server = await RolloutServer(config, engine).start()
    client = AsyncRolloutClient(f"127.0.0.1:{server.port}")
    try:
        await one_batch(client, args)  # warm-up
        runs = [await one_batch(client, args) for _ in range(args.repeats)]
    finally:
        await client.close()
        await server.stop(5)
        engine.shutdown()
    rates = [r["tokens"] / r["seconds"] for r in runs]
    delays = sorted(d for r in runs for d in r["delays"])
    return {
        "tokens_per_batch": runs[0]["tokens"],
        "tokens_per_s_median": statistics.median(rates),
        "tokens_per_s_all": rates,
        "stored_per_batch": runs[0]["stored"],
        "store_delay_ms_median": 1000 * statistics.median(delays),
        "store_delay_ms_p95": 1000 * delays[int(0.95 * (len(delays) - 1))],
    }


def compare(model: Path, args) -> dict:
    """Capture on and capture off, one engine after the other (``args.first`` first), on a
    route cache over an embedded Redis: each run's figures and ``overhead_percent``."""
    redis_server, redis_url = start_embedded_redis()
    store = RouteStore(connect(redis_url, cluster=False), ttl_ms=600_000)
    cache = RouteCacheServer(CacheConfig(host="127.0.0.1", port=0, grace_s=1), store).start()
    target = f"127.0.0.1:{cache.port}"
    try:
        results = {}
        for capture in (True, False) if args.first == "on" else (False, True):
            name = "capture_on" if capture else "capture_off"
            results[name] = asyncio.run(run_mode(model, target, capture, args))
    finally:
        cache.stop(0)
        redis_server.stop()
    on, off = results["capture_on"], results["capture_off"]
    assert on["tokens_per_batch"] == off["tokens_per_batch"], "runs generated different tokens"
    assert on["stored_per_batch"] == args.prompts * args.n and off["stored_per_batch"] == 0
    results["overhead_percent"] = 100 * (1 - on["tokens_per_s_median"] / off["tokens_per_s_median"])
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=["bench", "tiny"], default="bench")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--first",
        choices=["on", "off"],
        default="on",
        help="which run goes first (swap it to see order effects)",
    )
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()

    import torch

    torch.set_num_threads(1)  # this process only streams; the engine has its own processes
    work = Path(tempfile.mkdtemp(prefix="bench-rollout-"))
    size = BENCH_SIZE if args.size == "bench" else TINY_SIZE
    t0 = time.perf_counter()
    model = build_tiny_model(work / "model", seed=0, size=size)
    print(f"model built in {time.perf_counter() - t0:.0f} s: {size}")
    results = compare(model, args)
    on, off = results["capture_on"], results["capture_off"]
    overhead = results["overhead_percent"]
    results["workload"] = vars(args) | {"size": str(size), "out": None}
    print(json.dumps(results, indent=2, default=str))
    print()
    print("| run | tokens/s (median) | last token -> record stored, median / p95 |")
    print("|---|---|---|")
    print(
        f"| capture + cache writes | {on['tokens_per_s_median']:.1f} | "
        f"{on['store_delay_ms_median']:.1f} / {on['store_delay_ms_p95']:.1f} ms |"
    )
    print(f"| capture off | {off['tokens_per_s_median']:.1f} | - |")
    print(f"overhead: {overhead:.1f}%")
    if args.out:
        args.out.write_text(json.dumps(results, indent=2, default=str))


if __name__ == "__main__":
    main()
