"""``start_local_ray``: a node that misses Ray's start-up deadline is cleaned up and started again.

The miss itself cannot be produced on demand (Ray's 30 s deadline is hard-coded and a quiet
machine meets it), so ``ray.init`` is replaced here by a stand-in that leaves a child process
behind, as a failed node does, and raises Ray's own message.
"""

from __future__ import annotations

import subprocess

import pytest

from routereplay.dev import ray_local
from tests.verl.cpu import needs_verl

needs_verl()

TIMED_OUT = "The current node timed out during startup. This could happen because ..."


class FailingInit:
    """``ray.init`` failing its first ``failures`` calls with ``error``, each leaving a child
    process running (a failed node's GCS and raylet are the caller's children)."""

    def __init__(self, failures: int, error: str = TIMED_OUT):
        self.failures, self.error = failures, error
        self.calls: list[dict] = []
        self.children: list[subprocess.Popen] = []

    def __call__(self, **kwargs):
        self.calls.append(kwargs)
        if len(self.calls) <= self.failures:
            self.children.append(subprocess.Popen(["sleep", "60"]))
            raise RuntimeError(self.error)


@pytest.fixture
def init(monkeypatch):
    import ray

    installed: list[FailingInit] = []

    def install(failures: int, error: str = TIMED_OUT) -> FailingInit:
        stand_in = FailingInit(failures, error)
        monkeypatch.setattr(ray, "init", stand_in)
        installed.append(stand_in)
        return stand_in

    yield install
    # Whatever a test left running (the last failed start's child, or all of them when it
    # failed): no sleeping child outlives the test.
    for stand_in in installed:
        for child in stand_in.children:
            child.kill()
            child.wait()


def test_a_missed_deadline_kills_the_failed_nodes_processes_and_starts_again(init):
    stand_in = init(failures=ray_local.RAY_STARTS - 1)
    with pytest.warns(UserWarning, match="missed its start-up deadline") as warned:
        ray = ray_local.start_local_ray(num_cpus=2, include_dashboard=False)
    assert ray.init is stand_in
    assert stand_in.calls == [{"num_cpus": 2, "include_dashboard": False}] * ray_local.RAY_STARTS
    assert len(warned) == ray_local.RAY_STARTS - 1
    for child in stand_in.children:
        assert child.wait(timeout=10) == -9  # killed, not left running


def test_the_last_miss_and_any_other_error_are_raised(init):
    stand_in = init(failures=ray_local.RAY_STARTS)
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match="timed out during startup"):
        ray_local.start_local_ray()
    assert len(stand_in.calls) == ray_local.RAY_STARTS
    for child in stand_in.children[:-1]:
        assert child.wait(timeout=10) == -9

    stand_in = init(failures=1, error="object store memory too small")
    with pytest.raises(RuntimeError, match="object store memory"):
        ray_local.start_local_ray()
    assert len(stand_in.calls) == 1  # not retried
