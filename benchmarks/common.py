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
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "benchmarks.md"
RESULTS = ROOT / "results"


def median_time(fn, repeats: int, setup=None, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` over ``repeats`` runs (these machines are noisy), after
    ``warmup`` untimed runs (connections, numba's kernels, Redis's first touch of its memory:
    with ``--quick``'s 2 repeats, a cold first write put the first case at 0.18-0.22 of its
    floor in 5 of 5 runs, the others at 0.48-0.64); ``setup()``, untimed, before each."""
    times = []
    for i in range(warmup + repeats):
        if setup is not None:
            setup()
        start = time.perf_counter()
        fn()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


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
