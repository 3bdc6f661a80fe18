"""What the verl integration saves, for one trainer worker's micro-batches of 32K-token
Qwen3-30B-A3B samples (48 MoE layers, top-8 of 128 experts), in one run:

- bytes on the Ray path per batch: verl's ``routed_experts`` (int16 ``[bs, seq, 48, 8]``) against
  the integration's sample ids, each measured as Ray serializes it; the arithmetic for a step;
- time to move one worker's routes: verl's way (``ray.put`` of the tensor in the driver, a Ray
  actor's ``get`` of it, on a local Ray) against the integration's fetch from the route cache
  (its own process over a real redis-server), whole records and one pipeline stage's layers
  (PP4: 12 of 48), each with and without building verl's field; medians;
- the fetch time per worker against the training compute of its samples (arithmetic);
- the rollout side, per ``generate()`` call of one multi-turn sample: the route cache calls the
  server makes (``TurnWriter``: stat, the append, and a read-back of the tokens when this
  process did not write the sample's last turn), the bytes each call sends (only its new rows)
  against the whole history's routes the engine returns to verl on every call, and the time
  per call; medians.

Runs in the verl environment (``make verl``; ``run_all.py`` uses ``$VERL_PYTHON``).

Usage: python -m benchmarks.performance.bench_verl [--samples 4] [--tokens 32768] [--repeats 5]
[--quick]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import time

import numpy as np
import torch

from benchmarks.common import machine, median_time, write_section
from routereplay.dev.launch import free_port, start_service, stop_process
from routereplay.dev.synthetic import QWEN3_30B_A3B, synthetic_record
from routereplay.families.model_geometry import MoEGeometry

GEOMETRY = MoEGeometry(QWEN3_30B_A3B, num_hidden_layers=48)
STAGE_LAYERS = list(range(12))  # one PP4 stage's MoE layers
# Arithmetic of a step (stated, not measured): verl's usual GRPO batch of 32 prompts x 8
# samples, its Megatron layout for Qwen3-30B-A3B on 16 GPUs (DP2 x TP2 x PP4), H100s.
STEP_SAMPLES, DP, TP, PP = 256, 2, 2, 4
ACTIVE_PARAMS, H100_FLOPS, MFU = 3.3e9, 989e12, 0.4


def start_redis() -> tuple[subprocess.Popen, str]:
    """A redis-server on a free loopback port (no persistence)."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit("bench_verl needs redis-server on PATH")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    import redis

    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            return proc, f"redis://127.0.0.1:{port}/0"
        except redis.ConnectionError:
            time.sleep(0.05)
    raise SystemExit("redis-server did not start")


def ray_bytes(obj) -> int:
    """Bytes of ``obj`` as Ray serializes it into its object store."""
    import ray

    return ray._private.worker.global_worker.get_serialization_context().serialize(obj).total_bytes


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--samples", type=int, default=4, help="one worker's samples")
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--turns", type=int, default=8, help="calls of the multi-turn sample")
    parser.add_argument("--quick", action="store_true", help="2 samples of 4K tokens, 2 repeats")
    args = parser.parse_args()
    if args.quick:
        args.samples, args.tokens, args.repeats, args.turns = 2, 4096, 2, 4
    torch.set_num_threads(1)
    import ray

    from routereplay.dev.ray_local import start_local_ray
    from routereplay.rpc.client import RouteCacheClient
    from trainer.data.source import CacheSource
    from trainer.data.stage_reads import StageReads
    from verl_integration.fetch import RouteFetcher

    rng = np.random.default_rng(0)
    records = [
        synthetic_record(f"bench-verl-{i}", QWEN3_30B_A3B, args.tokens, rng)
        for i in range(args.samples)
    ]
    ids = [r.sample_id for r in records]
    input_ids = torch.nested.as_nested_tensor(
        [torch.from_numpy(r.token_ids.astype(np.int64)) for r in records], layout=torch.jagged
    )
    # verl's field as its rollout path ships it: every row, int16, padded [bs, seq, L, k].
    verl_field = torch.zeros(args.samples, args.tokens, 48, 8, dtype=torch.int16)
    for b, r in enumerate(records):
        verl_field[b, : r.num_rows] = torch.from_numpy(r.routes.astype(np.int16))
    id_column = np.array(ids, dtype=object)  # what the integration leaves on the Ray path

    redis_proc, url = start_redis()
    cache_proc = None
    try:
        cache_proc, target = start_service(
            "route_cache", "--redis-url", url, "--ttl-s", "3600", quiet=True
        )
        # Room for one copy of the field (Ray's minimum is 75 MiB).
        store = int(verl_field.nbytes * 1.5) + (80 << 20)
        start_local_ray(
            num_cpus=1, object_store_memory=store, include_dashboard=False, log_to_driver=False
        )
        with RouteCacheClient(target) as client:
            for r in records:
                client.write(r)
            rollout = {
                "remembered": rollout_turns(client, records[0], args.turns, remember=True),
                "read_back": rollout_turns(client, records[0], args.turns, remember=False),
            }

        @ray.remote(num_cpus=1)
        class Worker:
            def take(self, field):
                return int(field.shape[0])

        worker = Worker.remote()
        ray.get(worker.take.remote(torch.zeros(1)))

        def verl_way():
            ray.get(worker.take.remote(ray.put(verl_field)))

        fetchers = {
            "whole": RouteFetcher(StageReads(CacheSource(target), None), GEOMETRY),
            "stage": RouteFetcher(StageReads(CacheSource(target), STAGE_LAYERS), GEOMETRY),
        }
        times = {"verl_put_get": median_time(verl_way, args.repeats)}
        for name, fetcher in fetchers.items():
            times[f"{name}_fetch"] = median_time(lambda f=fetcher: f.records(ids), args.repeats)
            times[f"{name}_field"] = median_time(
                lambda f=fetcher: f.routes(ids, input_ids), args.repeats
            )
    finally:
        ray.shutdown()
        if cache_proc is not None:
            stop_process(cache_proc)
        redis_proc.terminate()
        redis_proc.wait(10)

    row_int16 = 48 * 8 * 2
    stored = sum(r.routes.nbytes for r in records)
    results = {
        "machine": machine(),
        "samples": args.samples,
        "tokens_per_sample": args.tokens,
        "ray_bytes_verl": ray_bytes(verl_field),
        "ray_bytes_integration": ray_bytes(id_column),
        "route_bytes_whole": stored,
        "route_bytes_stage": stored * len(STAGE_LAYERS) // 48,
        "seconds": times,
        "rollout_turns": rollout,
    }
    # A step, by arithmetic: verl gathers the batch's field to the driver, then dispatches each
    # DP shard to all TP x PP ranks of its group; the integration's ranks read their stage's
    # layers from the route cache, once per TP group (the stages partition the layers).
    per_sample = args.tokens * row_int16
    step = {
        "verl_ray_bytes": STEP_SAMPLES * per_sample * (1 + TP * PP),
        "integration_ray_bytes": STEP_SAMPLES * results["ray_bytes_integration"] // args.samples,
        "integration_cache_bytes": STEP_SAMPLES * args.tokens * 48 * 8,
        "worker_tokens": STEP_SAMPLES // DP * args.tokens,
    }
    # Training compute of one DP group's samples: forward + backward (6 x active params per
    # token) plus verl's old-log-prob forward (2 x), spread over its TP x PP GPUs.
    step["worker_compute_s"] = (
        8 * ACTIVE_PARAMS * step["worker_tokens"] / (TP * PP * H100_FLOPS * MFU)
    )
    # A worker fetches its stage's layers for its DP group's samples.
    scale = (STEP_SAMPLES // DP) / args.samples
    step["worker_fetch_s"] = times["stage_field"] * scale
    results["step"] = step
    write_section("verl", markdown(results, args), results)
    print(markdown(results, args))


class CountingClient:
    """The route cache client, counting each call and the route and token bytes it carries."""

    def __init__(self, client):
        self.client = client
        self.calls: list[tuple[str, int]] = []

    def stat(self, sample_id):
        self.calls.append(("stat", 0))
        return self.client.stat(sample_id)

    def read(self, sample_id, layers=None):
        record = self.client.read(sample_id, layers=layers)
        self.calls.append(("read", record.token_ids.nbytes + record.routes.nbytes))
        return record

    def write(self, record, more_turns=False):
        self.calls.append(("write", record.token_ids.nbytes + record.routes.nbytes))
        return self.client.write(record, more_turns=more_turns)

    def append(self, append):
        self.calls.append(("append", append.token_ids.nbytes + append.routes.nbytes))
        return self.client.append(append)


def rollout_turns(client, record, turns: int, remember: bool) -> dict:
    """One sample of ``record``'s tokens generated in ``turns`` calls (each call: the history as
    its prompt, an equal share of new tokens, the engine's routes of the whole history), written
    through ``TurnWriter`` as verl's server mix-in does. Per call: the route cache calls, the
    bytes they carry, the bytes of the engine's ``routed_experts`` that verl itself ships on
    every call, and the time; ``remember=False``: another process wrote the previous turn, so
    the history's tokens are read back for the content check."""
    from types import SimpleNamespace

    from verl_integration.rollout import TurnWriter

    sample = f"bench-verl-turns-{'remembered' if remember else 'read-back'}"
    ends = np.linspace(0, record.num_tokens, turns + 1).astype(int)[1:]
    ends[0] = max(ends[0], 2)
    counting = CountingClient(client)
    writer = TurnWriter(counting, GEOMETRY, remembered=4096 if remember else 0)
    per_call = []
    prompt_end = 1
    for end in ends:
        output = SimpleNamespace(
            token_ids=record.token_ids[prompt_end:end].tolist(),
            log_probs=None,
            routed_experts=record.routes[: end - 1],  # the engine: every row of the history
            stop_reason="completed",
            extra_fields={"global_steps": 0},
        )
        before = len(counting.calls)
        start = time.perf_counter()
        writer.write(sample, record.token_ids[:prompt_end].tolist(), output)
        seconds = time.perf_counter() - start
        calls = counting.calls[before:]
        per_call.append(
            {
                "tokens": int(end),
                "rpcs": len(calls),
                "calls": [name for name, _ in calls],
                "bytes": sum(size for _, size in calls),
                "engine_bytes": int(output.routed_experts.nbytes),
                "seconds": seconds,
            }
        )
        prompt_end = int(end)
    client.delete(sample)
    return {"turns": turns, "per_call": per_call}


def rollout_markdown(r: dict) -> str:
    rows = []
    for mode, label in (("remembered", "digest kept here"), ("read_back", "tokens read back")):
        calls = r["rollout_turns"][mode]["per_call"]
        later = calls[1:]
        rows.append(
            f"| {label} | {' + '.join(calls[0]['calls'])}; then "
            f"{' + '.join(later[-1]['calls'])} | "
            f"{sum(c['bytes'] for c in calls):,} | {sum(c['engine_bytes'] for c in calls):,} | "
            f"{statistics.median(c['seconds'] for c in later) * 1e3:.1f} |"
        )
    turns = r["rollout_turns"]["remembered"]["turns"]
    return f"""
One sample of {r["tokens_per_sample"]} tokens generated in {turns} calls (an equal share of new
tokens each, the history as each call's prompt), written as verl's server mix-in writes it.
Bytes: route and token bytes the route cache calls carry, all calls together, against the
engine's `routed_experts` verl itself ships through Ray on every call (the whole history, uint8).

| rollout side | route cache calls per call | bytes sent (all calls) | verl's bytes (all calls) | ms per later call (median) |
|---|---|---|---|---|
{chr(10).join(rows)}
"""  # noqa: E501


def markdown(r: dict, args) -> str:
    s, st = r["seconds"], r["step"]
    mib = 1 << 20
    gb = 1e9
    verl_mb = r["ray_bytes_verl"] / mib
    return f"""
## verl integration (`bench_verl.py`)

One trainer worker's {r["samples"]} samples of {r["tokens_per_sample"]} tokens, Qwen3-30B-A3B
routes (48 MoE layers, top-8 of 128). {r["machine"]}. Medians of {args.repeats}.

| on the Ray path per batch | bytes |
|---|---|
| verl: `routed_experts`, int16 `[{r["samples"]}, {r["tokens_per_sample"]}, 48, 8]` | {r["ray_bytes_verl"]:,} ({verl_mb:.1f} MiB) |
| with the integration: the sample ids | {r["ray_bytes_integration"]:,} |

| moving one worker's routes | route bytes | seconds | vs verl |
|---|---|---|---|
| verl: `ray.put` in the driver + a Ray actor's `get` (local Ray, 1 CPU) | {r["ray_bytes_verl"]:,} | {s["verl_put_get"]:.3f} | 1.00x |
| route cache, whole records: fetch | {r["route_bytes_whole"]:,} | {s["whole_fetch"]:.3f} | {s["whole_fetch"] / s["verl_put_get"]:.2f}x |
| route cache, whole records: fetch + verl's field | {r["route_bytes_whole"]:,} | {s["whole_field"]:.3f} | {s["whole_field"] / s["verl_put_get"]:.2f}x |
| route cache, one PP4 stage (12 layers): fetch | {r["route_bytes_stage"]:,} | {s["stage_fetch"]:.3f} | {s["stage_fetch"] / s["verl_put_get"]:.2f}x |
| route cache, one PP4 stage: fetch + verl's field | {r["route_bytes_stage"]:,} | {s["stage_field"]:.3f} | {s["stage_field"] / s["verl_put_get"]:.2f}x |

A step by arithmetic ({STEP_SAMPLES} samples of {r["tokens_per_sample"]} tokens, DP{DP} x
TP{TP} x PP{PP}): verl moves the field through Ray once to the driver and once to each of the
TP x PP ranks of a DP group, {st["verl_ray_bytes"] / gb:.1f} GB; with the integration Ray
carries {st["integration_ray_bytes"] / 1e3:.1f} kB of ids and the route cache serves
{st["integration_cache_bytes"] / gb:.1f} GB (uint8, each stage only its layers, once per TP
group). One worker fetching its stage's routes for its DP group's
{STEP_SAMPLES // DP} samples at this run's rate: {st["worker_fetch_s"]:.1f} s (in the
trainer's prefetch thread, overlapped with the previous step), against
{st["worker_compute_s"]:.1f} s of training compute for them (H100s at {MFU:.0%} MFU, forward +
backward + old log-probs, {ACTIVE_PARAMS / 1e9:.1f}B active parameters).
{rollout_markdown(r)}"""  # noqa: E501


if __name__ == "__main__":
    main()
