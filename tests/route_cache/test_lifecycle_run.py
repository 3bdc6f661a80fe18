"""The long-run benchmark (benchmarks/faults/bench_lifecycle.py) at its small size: a route cache
whose Redis holds 1/32 of the run's route bytes, writers faster than the trainer's own feed
path, the trainer stopped, back, killed and resumed, the route cache restarted. With freeing
it must pass every check; without (the route cache frees nothing, the old behaviour) Redis
fills, writes are refused past the writers' hold, and it must fail."""

from __future__ import annotations

from dataclasses import replace

from benchmarks.faults.bench_lifecycle import QUICK, report, run


def test_the_long_run_holds_memory_to_the_work_in_flight():
    result = run(QUICK)
    assert result["verdict"]["pass"], report(result)
    assert result["figures"]["refused"] > 0  # the budget acted: the writers were held back
    assert result["figures"]["trainer_processes"] == 2  # killed and resumed


def test_without_freeing_the_long_run_fails():
    result = run(replace(QUICK, free=False, phases=QUICK.phases[:1]))
    verdict = result["verdict"]
    assert not verdict["pass"] and verdict["dropped"], report(result)
