"""The benchmarks' own parts: the raw gRPC baseline moves the bytes it is given, the
pipeline benchmark's summary adds its stages up the way its report says, and the CPU count
per call is each process's own."""

import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from benchmarks.common import Run, Timings, interleaved, paired_ratio, timed_with_cpu
from benchmarks.performance.bench_pipeline import summarize
from benchmarks.performance.bench_route_cache import _cpu_cell
from benchmarks.performance.raw_grpc import RawClient
from routereplay.dev.launch import start_service, stop_process


@pytest.fixture(scope="module", params=["memory", "redis"])
def raw_target(request):
    """The bare service keeping the bytes in memory (the transport floor) or in Redis (the
    gRPC + Redis floor)."""
    root = Path(__file__).resolve().parent.parent  # where the benchmarks folder is
    env = {**os.environ, "PYTHONPATH": str(root)}
    args = (
        ()
        if request.param == "memory"
        else ("--redis-url", request.getfixturevalue("redis_node").url)
    )
    proc, target = start_service("benchmarks.performance.raw_grpc", *args, env=env, quiet=True)
    yield target
    stop_process(proc)


def test_raw_grpc_returns_what_was_written(raw_target):
    rng = np.random.default_rng(0)
    data = {
        key: rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        for key, size in (("a", 3 << 20), ("b", 1000), ("c", (1 << 20) + 1))
    }
    client = RawClient(raw_target)
    try:
        for key, value in data.items():
            chunks = [value[i : i + (1 << 20)] for i in range(0, len(value), 1 << 20)]
            assert client.write(key, chunks) == len(value)
        got = b"".join(client.read_batch(["c", "a", "b"]))
        assert got == data["c"] + data["a"] + data["b"]
        # A stage's share: the same bytes of each value, and only those.
        got = b"".join(client.read_batch(["c", "b"], (10, 900)))
        assert got == data["c"][10:900] + data["b"][10:900]
    finally:
        client.close()


def test_pipeline_summary_by_hand():
    on = [
        {
            "generate": 1.0,
            "store": 0.1,
            "fetch": 0.05,
            "reshard": 0.01,
            "route_bytes": 2**20,
            "tokens": 100,
            "record_tokens": 200,
        },
        {
            "generate": 3.0,
            "store": 0.3,
            "fetch": 0.15,
            "reshard": 0.03,
            "route_bytes": 2**20,
            "tokens": 100,
            "record_tokens": 200,
        },
        {
            "generate": 2.0,
            "store": 0.2,
            "fetch": 0.10,
            "reshard": 0.02,
            "route_bytes": 2**20,
            "tokens": 100,
            "record_tokens": 200,
        },
    ]
    off = [{"generate": 1.5, "store": 0.0}, {"generate": 2.5, "store": 0.0}]
    s = summarize(on, off)
    assert s["stage_s_median"] == pytest.approx(
        {"generate": 2.0, "store": 0.2, "fetch": 0.1, "reshard": 0.02}
    )
    assert s["end_to_end_s_median"] == pytest.approx(2.32)
    assert s["baseline_s_median"] == pytest.approx(2.0)
    assert s["route_moving_share"] == pytest.approx(0.32 / 2.32)
    assert s["overhead_vs_baseline"] == pytest.approx(0.16)
    assert s["route_mibs"]["fetch"] == pytest.approx(10.0)  # 1 MiB in 0.1 s
    assert s["end_to_end_route_mibs"] == pytest.approx(1 / 2.32)


def test_cpu_per_call_is_each_process_own():
    """This process's CPU per timed call against its own clock (``time.process_time``), the
    warm-up left out; a sleeping process spends none; an unknown one counts None."""
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    spent = []

    def spin():
        start = time.process_time()
        while time.process_time() - start < 0.1:
            pass
        spent.append(time.process_time() - start)

    try:
        pids = {"self": os.getpid(), "sleeper": sleeper.pid, "unknown": None}
        _, per_call = timed_with_cpu(spin, 4, pids)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert len(spent) == 5  # the warm-up and 4 timed calls
    assert per_call["self"] == pytest.approx(statistics.mean(spent[1:]), abs=0.01)
    assert per_call["sleeper"] < 0.01
    assert per_call["unknown"] is None


def test_interleaved_runs_take_turns_and_count_their_own_cpu():
    """One warm-up round, then one call of each run per round, each setup just before its
    call; each run's CPU is charged for its own calls only (a spinning run, not the idle one
    beside it)."""
    log = []

    def spin():
        log.append("spin")
        start = time.process_time()
        while time.process_time() - start < 0.05:
            pass

    runs = {
        "idle": Run(lambda: log.append("idle"), {"self": os.getpid()}, lambda: log.append("s")),
        "spin": Run(spin, {"self": os.getpid(), "unknown": None}),
    }
    timings = interleaved(runs, 3)
    assert log == ["s", "idle", "spin"] * 4
    assert len(timings["idle"].times) == len(timings["spin"].times) == 3
    assert timings["spin"].cpu["self"] == pytest.approx(0.05, abs=0.015)
    assert timings["spin"].cpu["unknown"] is None
    assert timings["idle"].cpu["self"] < 0.01


def test_paired_ratio_compares_calls_of_the_same_round():
    """A load that slows both sides of one round leaves the ratio alone: the ratio of the
    medians would be 20 here, the rounds' own ratios are 2, 20 and 2."""
    run = Timings([1.0, 1.0, 10.0], {})
    baseline = Timings([2.0, 20.0, 20.0], {})
    assert paired_ratio(run, baseline) == 2.0
    assert baseline.median / run.median == 20.0
    assert paired_ratio(run, baseline, scale=0.25) == 0.5  # a quarter of the bytes each call


def test_cpu_cells_follow_the_tables_column_order():
    # Runs name their processes in any order (the server last, say); the columns do not move.
    assert _cpu_cell({"client": 1.0, "redis": 3.0, "server": 2.0}) == "1.00 / 2.00 / 3.00"
    assert _cpu_cell({"client": 1.0, "redis": None}) == "1.00 / - / -"
