"""Trainer replay overhead: a training step (forward + backward) with R3 replay against
``disabled``, on the same batches, in the same run, same weights.

The replayed routes are the model's own natural routes (recorded in a first pass), so both
sides do identical expert work and the difference is replay's own cost: megatron's
``RouterReplay`` hook, the mask, the ``REPLAY_BACKWARD`` bookkeeping. ``disabled`` is a model
built without ``moe_enable_routing_replay``. The two alternate, repeat after repeat, and the
medians are compared (the machine is shared and noisy). Alignment (records -> replay ids) is
timed separately; fetching is excluded from that comparison.

A second part runs the RL loop (``trainer.train.train``, R3, one PPO epoch) on batches fetched
from a real route cache (``RouteCacheServer`` over an embedded valkey): per batch, the fetch
(one ``read_batch``), the alignment, the time the loop waited for the batch, and the step's
time, with prefetch on and off.

Usage: ``python -m benchmarks.performance.bench_trainer [--repeats N] [--no-write]``
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from benchmarks.common import batch_copies, machine, write_section

# Small enough for a CPU step well under a second, with many routers and experts so that
# per-router costs weigh as much as they can.
SIZE_KW = dict(
    hidden_size=256,
    intermediate_size=512,
    moe_intermediate_size=128,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=4,
    head_dim=32,
    num_experts=32,
    num_experts_per_tok=4,
)


LENGTHS = [256, 200, 160, 256]  # one micro-batch of 4 samples


def step_loss(model, batch) -> torch.Tensor:
    logits = model(batch.token_ids, batch.position_ids(), batch.attention_mask())
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return -logp.gather(-1, batch.token_ids[:, 1:, None]).mean()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from routereplay.dev.tiny_model import MoESize, build_tiny_model
    from trainer.distributed import single_process

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(f"{tmp}/model", seed=0, size=MoESize(**SIZE_KW))
        groups = single_process.init_single_process(f"file://{tmp}/pg", seed=0)
        try:
            times, replay, records = time_replay(model_dir, groups, LENGTHS, args.repeats)
            fetch = fetch_vs_step(model_dir, replay, records, args.batches)
        finally:
            single_process.shutdown()

    med = {k: statistics.median(v) for k, v in times.items()}
    overhead = med["R3"] / med["disabled"] - 1
    results = {
        "model": "Qwen3-MoE, 8 layers (layer 0 dense), hidden 256, 32 experts top-4",
        "tokens": sum(LENGTHS),
        "repeats": args.repeats,
        "median_s": med,
        "replay_overhead": overhead,
        "align_share_of_step": med["align"] / med["disabled"],
        "fetch": fetch,
        "machine": machine(),
        "torch": torch.__version__,
    }
    markdown = f"""## Trainer: replay overhead

`python -m benchmarks.performance.bench_trainer` ({results["machine"]}; torch {torch.__version__},
CPU, 1
thread). Model: {results["model"]}; megatron-core, float32; one micro-batch of 4 samples,
{results["tokens"]} tokens; forward + backward; medians of {args.repeats} alternating repeats.
R3 replays the model's own natural routes (identical expert work), alignment included;
`disabled` is the same weights built without `moe_enable_routing_replay`.

| | median step (s) |
|---|---|
| disabled | {med["disabled"]:.4f} |
| R3 replay (align + replayed forward + backward) | {med["R3"]:.4f} |
| of which alignment (records -> replay ids) | {med["align"]:.4f} |

Replay overhead: **{overhead * 100:+.2f}%** (target: at most 2%); alignment alone is
{results["align_share_of_step"] * 100:.2f}% of the step. Differences under about 1% are within
this shared machine's noise.

### Fetch + align against the step, from a real route cache

The RL loop (R3, one PPO epoch, no comparison pass: an old-logprob forward and a forward +
backward + AdamW step) over {fetch["batches"]} batches of 4 samples ({fetch["tokens"]} tokens),
each batch's records read from a `RouteCacheServer` over an embedded valkey in one `read_batch`
call. Medians per batch over the batches after the first (the first fetch has nothing to hide
behind):

| | prefetch on | prefetch off |
|---|---|---|
| fetch (read_batch, s) | {fetch["on"]["fetch"]:.4f} | {fetch["off"]["fetch"]:.4f} |
| loop wait (s) | {fetch["on"]["fetch_wait"]:.4f} | {fetch["off"]["fetch_wait"]:.4f} |
| align (s) | {fetch["on"]["align"]:.4f} | {fetch["off"]["align"]:.4f} |
| step (s) | {fetch["on"]["step"]:.4f} | {fetch["off"]["step"]:.4f} |

With prefetch the wait is {fetch["on"]["fetch_wait"] / fetch["on"]["step"] * 100:.2f}% of the
step (target: hidden); fetch + align is {fetch["fetch_align_share"] * 100:.2f}% of the step.
"""
    print(markdown)
    if not args.no_write:
        write_section("trainer", markdown, results)
    return results


def time_replay(model_dir, groups, lengths, repeats: int):
    """Step times of ``disabled`` and R3 (alignment included) and of alignment alone, in
    alternation, on one batch of ``lengths`` tokens and the same weights. The records are the
    transformers reference rollout's (``routereplay.dev.hf_rollout``; float32 routes equal
    megatron's natural routes) of random prompts one token shorter.

    Returns:
        ``(times, replay, records)``: seconds per repeat under ``disabled``, ``R3`` and
        ``align``; the model built for replay; the batch's records (its natural routes).
    """
    from routereplay.dev.hf_rollout import random_prompts, rollout_records
    from trainer.layout.align import align_routes
    from trainer.layout.batch import PaddedBatch
    from trainer.model.build import build_model

    plain = build_model(model_dir, routing_replay=False, pg_collection=groups)
    replay = build_model(model_dir, routing_replay=True, pg_collection=groups)
    prompts = random_prompts(len(lengths), [n - 1 for n in lengths], vocab=512, seed=0)
    records = rollout_records(model_dir, prompts, group_size=1, new_tokens=1)
    batch = PaddedBatch.from_samples(
        [r.sample_id for r in records],
        [r.token_ids for r in records],
        padding_side="right",
        pad_id=1,
    )
    layers = replay.replay.layers

    def align():
        return align_routes(batch, records, replay.geometry, layers)

    def run_disabled():
        plain.model.zero_grad(set_to_none=True)
        step_loss(plain.model, batch).backward()

    def run_r3():
        replay.model.zero_grad(set_to_none=True)
        aligned = align()
        with replay.replay.step():
            with replay.replay.forward(aligned.indices):
                loss = step_loss(replay.model, batch)
            with replay.replay.backward():
                loss.backward()

    times: dict[str, list[float]] = {"disabled": [], "R3": [], "align": []}
    run_disabled(), run_r3()  # warm-up
    order = [("disabled", run_disabled), ("R3", run_r3), ("align", align)]
    for i in range(repeats):
        # Alternate which side runs first, so slow drifts of the machine cancel.
        for name, fn in order if i % 2 == 0 else order[1::-1] + order[2:]:
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times, replay, records


def fetch_vs_step(model_dir, built, records, batches: int) -> dict:
    """Fetch + align time per batch against step time, from a real route cache (prefetch on
    and off). ``records`` are one batch's records; each batch gets copies under new ids."""

    from route_cache.config import Config
    from route_cache.connection import connect
    from route_cache.embedded import start_embedded_redis
    from route_cache.server import RouteCacheServer
    from route_cache.store import RouteStore
    from trainer.config import load_config
    from trainer.data.source import CacheSource
    from trainer.optim import AdamW
    from trainer.train import train

    valkey, url = start_embedded_redis()
    client = connect(url, cluster=False)
    server = RouteCacheServer(
        Config(host="127.0.0.1", port=0, grace_s=1), RouteStore(client, ttl_ms=600_000)
    ).start()
    source = CacheSource(f"127.0.0.1:{server.port}")
    out: dict = {"batches": batches, "tokens": int(sum(r.token_ids.size for r in records))}
    try:
        for prefetch in ("on", "off"):
            plans = batch_copies(source.client, records, batches, prefetch)
            config = load_config(
                None,
                [
                    f"model.path={model_dir}",
                    "router_replay.mode=R3",
                    "route_cache.target=x",
                    "train.batch_size=4",
                    "train.micro_batch_size=4",
                    "train.ppo_epochs=1",
                    "report.compare=false",
                    f"data.prefetch={prefetch == 'on'}",
                ],
            )
            reports = train(config, plans, source=source, built=(built, AdamW(built.model, 1e-5)))
            times = [r.time_s for r in reports[1:]]
            out[prefetch] = {
                "fetch": statistics.median(t.fetch for t in times),
                "fetch_wait": statistics.median(t.fetch_wait for t in times),
                "align": statistics.median(t.align for t in times),
                "step": statistics.median(
                    t.align + t.old_logprob + t.compare + t.update for t in times
                ),
            }
    finally:
        source.close()
        server.stop(0)
        client.close()
        valkey.stop()
    on = out["on"]
    out["fetch_align_share"] = (on["fetch"] + on["align"]) / on["step"]
    return out


if __name__ == "__main__":
    main()
