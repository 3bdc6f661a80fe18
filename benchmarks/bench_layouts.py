"""The RL step in each trainer layout against one rank, and replay's cost in each.

``python -m trainer`` runs the same R3 and ``disabled`` steps on the same records (the model's
own float32 rollout from transformers) in each layout: one rank with padded micro-batches
(the baseline), one rank packed, 2 data-parallel ranks, TP2 + SP, 2 pipeline stages (1F1B),
2 pipeline stages packed. A step's time is its old-logprob and update passes (no comparison
pass), the median over the steps after the first; each layout runs ``disabled`` and R3 in
alternation, ``--repeats`` times, so the machine's drifts cancel. Replay overhead is R3
against ``disabled`` in the same layout. Processes are started once per run (megatron's import
and the build are outside the timed step).

Usage: ``python -m benchmarks.bench_layouts [--steps N] [--repeats N] [--quick] [--no-write]``
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

from benchmarks.bench_trainer import SIZE_KW
from benchmarks.common import machine, write_section

ROOT = Path(__file__).resolve().parents[1]
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


def run_trainer(model_dir, records, out: Path, mode: str, ranks: int, extra, steps: int):
    """Step times (s) of one ``python -m trainer`` run, the first step left out."""
    head = [sys.executable]
    if ranks > 1:
        head += ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    report = out / f"{mode}.json"
    args = ["-m", "trainer", f"model.path={model_dir}", f"data.records_file={records}",
            f"router_replay.mode={mode}", "train.batch_size=8", "train.micro_batch_size=4",
            "train.mini_batch_size=8", "train.ppo_epochs=1", "report.compare=false",
            "data.prefetch=false", *extra,
            "--steps", str(steps), "--report", str(report)]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHONPATH=str(ROOT))
    env.pop("WORLD_SIZE", None)
    proc = subprocess.run([*head, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"{mode} {extra}: {proc.stderr[-3000:]}")
    reports = json.loads(report.read_text())
    return [r["time_s"]["old_logprob"] + r["time_s"]["update"] for r in reports[1:]]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="2 layouts, 3 steps, 1 repeat")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.repeats = 3, 1
    layouts = {k: v for k, v in LAYOUTS.items() if not args.quick or k in QUICK}

    from routereplay.record_file import save_records
    from routereplay.tiny_model import MoESize, build_tiny_model
    from tests.trainer.hf_rollout import random_prompts, rollout_records

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

`python -m benchmarks.bench_layouts` ({results["machine"]}; every process 1 thread, so a
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
