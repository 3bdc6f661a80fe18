"""The main job end to end (real route cache, real vLLM, real megatron-core), and Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm")
pytest.importorskip("megatron.core")

ROOT = Path(__file__).resolve().parent.parent


def session_processes(sid: int) -> list[int]:
    """PIDs of live processes in session ``sid`` (field 6 of /proc/PID/stat)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def test_main_job_reports_every_mode(tmp_path):
    out = tmp_path / "results"
    result = subprocess.run(
        [sys.executable, "-m", "pipeline", "--n", "2", "--max-tokens", "16", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "every route valid" in result.stdout
    report = json.loads((out / "report.json").read_text())
    assert set(report) == {"disabled", "R3", "R2"}
    for mode, steps in report.items():
        assert steps, mode
        first = steps[0]
        assert first["agreement"]["layers"] == [1, 2, 3]  # layer 0 is dense
        assert all(0.5 < a <= 1.0 for a in first["agreement"]["exact"])
        assert {"natural", "replayed"} <= set(first["gap"])
        replayed = first["rows"]["replayed_fraction"]
        assert replayed == 0.0 if mode == "disabled" else replayed > 0.9
    assert (out / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_ctrl_c_leaves_no_process_behind(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "--out", str(tmp_path)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 300
        for line in proc.stdout:  # wait until both services run and generation starts
            if "generating" in line or time.monotonic() > deadline:
                break
        assert len(session_processes(proc.pid)) > 3  # cache, valkey, rollout server, vLLM
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        proc.wait(120)
        deadline = time.monotonic() + 60
        while session_processes(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert session_processes(proc.pid) == []
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
