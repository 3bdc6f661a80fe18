"""What the benchmarks share: timing with medians, the machine's description, and writing a
results table into its own section of docs/benchmarks.md."""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import re
import statistics
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "results"


def wall_times(fn, repeats: int, setup=None, warmup: int = 0) -> list[float]:
    """Wall time of each of ``repeats`` runs of ``fn()``, after ``warmup`` untimed runs;
    ``setup()``, untimed, before each."""
    times = []
    for i in range(warmup + repeats):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return times


def median_time(fn, repeats: int, setup=None, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs (these machines are noisy), after
    ``warmup`` untimed runs (connections, numba's kernels, Redis's first touch of its memory:
    with ``--quick``'s 2 repeats, a cold first write put the first case at 0.18-0.22 of its
    floor in 5 of 5 runs, the others at 0.48-0.64); ``setup()``, untimed, before each."""
    return statistics.median(wall_times(fn, repeats, setup, warmup))


def wait_until(condition, timeout_s: float, what: str) -> None:
    """Poll ``condition()`` until it holds; RuntimeError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} did not happen within {timeout_s:.0f} s")
        time.sleep(0.05)


def cpu_seconds(pid: int | None) -> float | None:
    """User + system CPU seconds the process ``pid`` (all its threads) has used so far; None
    where it cannot be told (no pid, not Linux, the process gone)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_with_cpu(fn, repeats: int, pids: dict[str, int | None], setup=None):
    """``median_time(fn, repeats, setup)``, and the CPU seconds each process of ``pids``
    (name -> pid) spent per timed call of ``fn`` (the setups included; the warm-up run not):
    on a machine whose cores every process shares, where a gap in throughput is paid. Counted
    in the kernel's ticks (10 ms); a process whose CPU cannot be told counts None. One run of
    ``interleaved``."""
    timings = interleaved({"": Run(fn, pids, setup)}, repeats)[""]
    return timings.median, timings.cpu


@dataclasses.dataclass(frozen=True)
class Run:
    """One measured call for ``interleaved``: ``fn``; the processes whose CPU it is charged
    (role -> pid); ``setup()``, untimed, before each call (its CPU counted)."""

    fn: Callable[[], object]
    pids: dict[str, int | None]
    setup: Callable[[], object] | None = None


@dataclasses.dataclass
class Timings:
    """A run's wall time of each timed call, and each process's CPU seconds per call (None
    where it cannot be told)."""

    times: list[float]
    cpu: dict[str, float | None]

    @property
    def median(self) -> float:
        return statistics.median(self.times)


def interleaved(runs: dict[str, Run], repeats: int) -> dict[str, Timings]:
    """Each run timed ``repeats`` times, the runs taking turns (one call of each per round,
    after an untimed warm-up round), so that the calls compared in ``paired_ratio`` were made
    under the same conditions: on a shared machine whose load drifts, a baseline timed
    minutes apart from what it is held against moves each ratio by more than the change it is
    meant to show."""
    for run in runs.values():
        if run.setup is not None:
            run.setup()
        run.fn()
    out = {name: Timings([], dict.fromkeys(run.pids, 0.0)) for name, run in runs.items()}
    for _ in range(repeats):
        for name, run in runs.items():
            before = {role: cpu_seconds(pid) for role, pid in run.pids.items()}
            if run.setup is not None:
                run.setup()
            start = time.perf_counter()
            run.fn()
            out[name].times.append(time.perf_counter() - start)
            cpu = out[name].cpu
            for role, pid in run.pids.items():
                after = cpu_seconds(pid)
                if after is None or before[role] is None or cpu[role] is None:
                    cpu[role] = None
                else:
                    cpu[role] += (after - before[role]) / repeats
    return out


def paired_ratio(run: Timings, baseline: Timings, scale: float = 1.0) -> float:
    """``run``'s throughput over ``baseline``'s, the median over rounds of the two calls of
    the same round: ``baseline``'s time over ``run``'s, times ``scale`` (``run``'s bytes over
    ``baseline``'s, where they move different amounts)."""
    return statistics.median(scale * b / r for r, b in zip(run.times, baseline.times, strict=True))


def machine() -> str:
    versions = ", ".join(
        f"{name} {metadata.version(name)}" for name in ("grpcio", "protobuf", "redis", "numpy")
    )
    return (
        f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}; "
        f"{versions}"
    )


def write_section(name: str, markdown: str, results: dict) -> None:
    """Replace the ``name`` section of docs/benchmarks.md and save the raw results as JSON."""
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{name}.json").write_text(json.dumps(results, indent=2))
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    block = f"{begin}\n{markdown.strip()}\n{end}"
    text = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else f"{text}\n{block}\n"
    DOCS.write_text(text)


def batch_copies(client, records, batches: int, tag: str) -> list:
    """``batches`` copies of one batch's ``records`` written to the route cache under new ids
    (``{tag}-{batch}-{sample id}``), as the trainer's batch plans (one per copy)."""
    from trainer.data.source import BatchPlan

    plans = []
    for b in range(batches):
        copies = [dataclasses.replace(r, sample_id=f"{tag}-{b}-{r.sample_id}") for r in records]
        for copy in copies:
            client.write(copy)
        plans.append(BatchPlan([c.sample_id for c in copies]))
    return plans
