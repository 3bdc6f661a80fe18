"""Every benchmark of the project, one after the other (``make bench``).

Each benchmark compares against a baseline measured in the same run, on the same data:

- ``route_cache``: records written and batch-read through the route cache service against the
  same bytes through raw redis-py pipelines (target: at least 0.5x) and through a trivial
  bytes-in/bytes-out gRPC service, and stored bytes per token against int32, int16 and raw
  uint8 routes.
- ``route_cache_calls``: one write or one-record read at a time, small and 4K-token records,
  through the route cache against the gRPC + Redis floor: wall time and each process's CPU
  per call (what a call costs by itself, and on which side).
- ``mooncake``: the same records written, batch-read and stage-read through the route cache
  and through Mooncake's store (its master and TCP transport on this machine; ``make
  mooncake``), MiB/s and ratios (target: stage reads at least as fast as Mooncake).
- ``rollout``: generation with routed-expert capture and record writes against the same server
  with capture off (same model, prompts and greedy tokens; target: at most 3% fewer tokens/s),
  and the delay from a sample's last token to its record being readable.
- ``layouts``: the RL step in each trainer layout against one rank, R3 against ``disabled``;
  and (its ``layout_reads`` section) the route bytes the route cache served per step in each
  layout, against the stored bytes of the step's batch (target: at most 1.05x).
- ``families_glm4_moe``: the ``rollout`` and ``trainer`` comparisons (capture on against off,
  R3 against ``disabled``) for a GLM-4.5 model at the rollout benchmark's size, in one run
  (targets: at most 3% and 2%).
- ``trainer``: a training step with R3 replay against ``disabled`` on the same batches and
  weights (target: at most 2%), alignment on its own, and fetch + align against step time from
  a real route cache with prefetch on and off.
- ``reshard``: one rank's layout of a batch (``trainer.layout.plan_step``: micro-batches and
  replay ids) for several parallel layouts against a plain copy of the same route bytes.
- ``faults``: the fault run: writers and feed consumers while route cache replicas, Redis
  masters, a consumer and the network fail on a schedule; a checker's verdict on the history
  (no acknowledged record lost, every published sample trained once), write availability,
  latency outside and during each fault, recovery per fault (``docs/reliability.md``).
- ``lifecycle``: the long run: writers faster than the trainer's own feed path, through a Redis
  whose ``maxmemory`` is at most 1/20 of the run's route bytes; steady state, the trainer
  stopped, back, killed and resumed, the route cache restarted; Redis memory against the route
  bytes in flight (target: at most 1.2x plus Redis's buffers), writes refused and retried,
  nothing lost, dropped or freed before its commit (``docs/route_cache.md``, "Lifecycle").
- ``pipeline``: one RL batch end to end (rollout server, route cache, a trainer rank's fetch
  and reshard), time per stage and the share spent moving routes, against the same engine
  behind a server that stores nothing (interleaved) and the engine alone with capture off.
- ``stability``: the real pipeline as an RL run of 60 steps per mode (two families with narrow
  router margins, bf16 trainer against the float32 rollout, 2 seeds): the training-inference KL,
  the largest log-prob gap, routing agreement, clip fraction, gradient norm and reward per step
  in ``disabled``, R2, R3 and R3 with a float32 trainer, the paired replayed / natural KL of
  each step, and a collapse probe running every mode at each high learning rate (target: R3's
  median KL over the last 20 steps at most 0.5x ``disabled``'s). Its experiments (bf16
  rollout, margin sweep, independent seeds, epochs, group size, staleness) are flags run apart
  (``--tag``), not part of ``make bench``.
- ``verl``: in verl's environment, the verl integration's bytes on the Ray path per batch of
  32K-token Qwen3-30B-A3B samples against verl's route tensor, and one worker's routes moved
  through Ray (put, an actor's get) against fetched from the route cache (whole, one stage).
- ``scaling``: no measurement; the route cache figures of this run carried to a fleet
  (route bytes/s, route cache replicas, Redis shards, a trainer rank's memory).

Each writes its section of docs/benchmarks.md and results/<name>.json. ``--quick`` runs every
benchmark at a small size as a smoke test and writes to results/quick/ instead, so the numbers
in the docs stay those of full runs.

Usage: python benchmarks/run_all.py [--quick] [--only NAME ...] [--list]
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Benchmark:
    name: str  # its section of the docs and its results file
    script: str
    quick: tuple[str, ...]  # arguments of the smoke run
    measures: str
    # The environment it runs in: "" the project's, "verl" verl's ($VERL_PYTHON, make verl).
    env: str = ""


BENCHMARKS = (
    Benchmark(
        "route_cache",
        "performance/bench_route_cache.py",
        ("--quick",),
        "route cache write / batch read vs raw redis-py; bytes per token",
    ),
    Benchmark(
        "route_cache_calls",
        "performance/bench_route_cache_calls.py",
        ("--quick",),
        "the route cache per call, one at a time, vs the gRPC + Redis floor: wall and each "
        "process's CPU",
    ),
    Benchmark(
        "mooncake",
        "performance/bench_mooncake.py",
        ("--quick",),
        "route cache vs Mooncake's store (its own venv, make mooncake): write, batch read, "
        "stage read of the same records",
    ),
    Benchmark(
        "rollout",
        "performance/bench_rollout.py",
        ("--size", "tiny", "--prompts", "2", "--n", "2", "--max-tokens", "16", "--repeats", "2"),
        "rollout tokens/s with capture + record writes vs capture off",
    ),
    Benchmark(
        "trainer",
        "performance/bench_trainer.py",
        ("--repeats", "3", "--batches", "2"),
        "training step with R3 replay vs disabled; fetch + align vs step",
    ),
    Benchmark(
        "families_glm4_moe",
        "performance/bench_families.py",
        ("--quick",),
        "GLM-4.5 (DeepSeek-V3 router): capture on vs off, R3 vs disabled step",
    ),
    Benchmark(
        "layouts",
        "performance/bench_layouts.py",
        ("--quick",),
        "the RL step per trainer layout (PP, TP, DP, packing) vs one rank; replay overhead in "
        "each; route bytes read per step vs stored",
    ),
    Benchmark(
        "reshard",
        "performance/bench_reshard.py",
        ("--tokens", "4096", "--samples", "4", "--repeats", "2"),
        "one rank's micro-batches and replay ids per layout (plan_step) vs a plain copy",
    ),
    Benchmark(
        "alternatives",
        "performance/bench_alternatives.py",
        ("--quick",),
        "int32/int16 tensors via pickle and torch.save vs the codec vs memcpy; bytes vs limit",
    ),
    Benchmark(
        "load",
        "performance/bench_load.py",
        ("--quick",),
        "concurrent writers and batch readers: latencies, errors, records lost",
    ),
    Benchmark(
        "faults",
        "faults/bench_faults.py",
        ("--quick",),
        "load under faults (replica, master, node, consumer, network): checker verdict, "
        "availability, latency, recovery",
    ),
    Benchmark(
        "lifecycle",
        "faults/bench_lifecycle.py",
        ("--quick",),
        "a long run through a Redis holding a small fraction of its route bytes: memory vs "
        "bytes in flight, backpressure, exactly once through a trainer kill and a route cache "
        "restart",
    ),
    Benchmark(
        "pipeline",
        "performance/bench_pipeline.py",
        ("--quick",),
        "rollout -> route cache -> trainer fetch + reshard per batch vs storing nothing",
    ),
    Benchmark(
        "stability",
        "stability/bench_stability.py",
        ("--quick",),
        "an RL run per replay mode through the real pipeline: training-inference KL, routing "
        "agreement, clip fraction, gradient norm per step; collapse probe",
    ),
    Benchmark(
        "verl",
        "performance/bench_verl.py",
        ("--quick",),
        "verl integration: Ray bytes per batch; a worker's routes via Ray put/get vs route "
        "cache stage reads",
        "verl",
    ),
    Benchmark(
        "scaling",
        "performance/scaling_model.py",
        (),
        "arithmetic: route bytes/s, replicas, shards, trainer memory for a fleet (runs last)",
    ),
)


def run_one(docs: str, results: str, module: str, *args: str) -> None:
    """In a child process: run ``module`` as ``__main__`` with its sections written to
    ``docs`` and its JSON to ``results``."""
    import benchmarks.common

    benchmarks.common.DOCS, benchmarks.common.RESULTS = Path(docs), Path(results)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


def rollout_section(path: Path, machine: str) -> tuple[str, dict]:
    """bench_rollout.py writes JSON only: its section of the docs, from that JSON."""
    data = json.loads(path.read_text())
    on, off = data["capture_on"], data["capture_off"]
    work = data["workload"]
    markdown = f"""## Rollout: capture overhead

`python benchmarks/performance/bench_rollout.py` (from `make bench`): {work["prompts"]} prompts x
{work["n"]} samples of {work["max_tokens"]} tokens, {work["repeats"]} repeats, medians; model
{work["size"]}. Machine: {machine}. The same server code, model and prompts with capture on (routes captured, validated and written
to a real route cache over Redis) against capture off (vLLM's
`enable_return_routed_experts=False`, nothing stored), in the same run. Target: overhead at most
3%.

| run | tokens/s (median) | last token -> record stored, median / p95 |
|---|---|---|
| capture + cache writes | {on["tokens_per_s_median"]:.1f} | {on["store_delay_ms_median"]:.1f} / {on["store_delay_ms_p95"]:.1f} ms |
| capture off | {off["tokens_per_s_median"]:.1f} | - |

Overhead: **{data["overhead_percent"]:.1f}%**.
"""  # noqa: E501
    return markdown, data


def rel(path: Path) -> Path:
    return path.relative_to(ROOT)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_one"]:
        run_one(*argv[1:])
        return 0
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        epilog="benchmarks: " + ", ".join(b.name for b in BENCHMARKS),
    )
    parser.add_argument(
        "--quick", action="store_true", help="small sizes, a smoke test; writes to results/quick/"
    )
    parser.add_argument(
        "--only", nargs="+", choices=[b.name for b in BENCHMARKS], help="run only these"
    )
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = parser.parse_args(argv)
    if args.list:
        for b in BENCHMARKS:
            print(f"{b.name:12} {b.script:36} {b.measures}")
        return 0
    results = ROOT / "results" / ("quick" if args.quick else "")
    docs = results / "benchmarks.md" if args.quick else ROOT / "docs" / "benchmarks.md"
    results.mkdir(parents=True, exist_ok=True)
    chosen = [b for b in BENCHMARKS if not args.only or b.name in args.only]
    summary = []
    for i, bench in enumerate(chosen, 1):
        extra = list(bench.quick if args.quick else ())
        if bench.name == "rollout":
            extra += ["--out", str(results / "rollout.raw.json")]
        print(f"\n=== [{i}/{len(chosen)}] {bench.name}: {bench.measures}", flush=True)
        python = sys.executable
        if bench.env == "verl":
            python = os.environ.get("VERL_PYTHON", str(ROOT / ".venv-verl" / "bin" / "python"))
        command = [
            python,
            "-m",
            "benchmarks.run_all",
            "_one",
            str(docs),
            str(results),
            "benchmarks." + Path(bench.script).with_suffix("").as_posix().replace("/", "."),
            *extra,
        ]
        start = time.perf_counter()
        code = subprocess.run(command, cwd=ROOT, env=os.environ.copy()).returncode
        if code == 0 and bench.name == "rollout":
            import benchmarks.common as common

            common.DOCS, common.RESULTS = docs, results
            raw = results / "rollout.raw.json"
            markdown, data = rollout_section(raw, common.machine())
            common.write_section("rollout", markdown, {"machine": common.machine(), **data})
            raw.unlink()
        summary.append((bench.name, code, time.perf_counter() - start))
    print(f"\n=== {'quick ' if args.quick else ''}benchmarks done")
    for name, code, seconds in summary:
        status = "ok" if code == 0 else f"FAILED (exit {code})"
        print(f"  {name:12} {status:18} {seconds:7.0f} s   {rel(results / (name + '.json'))}")
    print(f"  sections in {rel(docs)}")
    return 0 if all(code == 0 for _, code, _ in summary) else 1


if __name__ == "__main__":
    raise SystemExit(main())
