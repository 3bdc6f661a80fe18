"""The load test, small: concurrent writers and batch readers against a route cache process for
a few seconds; no errors, no corrupt read, no acknowledged record lost. The driver is
benchmarks/performance/bench_load.py, which runs it at full size."""

from __future__ import annotations

from benchmarks.performance.bench_load import LoadConfig, run_load, start_cache
from routereplay.dev.launch import stop_process
from routereplay.dev.synthetic import QWEN3_30B_A3B


def test_load_small_loses_nothing(redis_node):
    proc, target = start_cache(redis_node.url)
    try:
        config = LoadConfig(
            writers=2,
            readers=2,
            duration_s=5.0,
            tokens=256,
            batch=4,
            max_writes=300,
            pool=4,
            geometry=QWEN3_30B_A3B,
        )
        results = run_load(target, config)
        assert proc.poll() is None, "the route cache process died under load"
    finally:
        stop_process(proc, 10)
    assert results["records_written"] > 0 and results["records_read"] > 0, results
    assert results["errors"] == {}, results
    assert results["corrupt_reads"] == 0, results
    assert results["records_lost"] == 0, results
    assert results["latency"]["write"]["p99_ms"] is not None
