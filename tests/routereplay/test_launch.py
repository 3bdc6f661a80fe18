"""Stopping a service takes its whole process group with it: a server that dies without
shutting down its helpers (vLLM's engine processes) leaves nothing behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from routereplay.dev.launch import stop_process

# A parent that starts a child which outlives it (as vLLM's engine core outlives a killed
# server), prints the child's pid, then waits.
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
print(child.pid, flush=True)
time.sleep(300)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead too: only its parent can reap it.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(") ")[1][0] != "Z"


def wait_dead(pid: int) -> bool:
    deadline = time.monotonic() + 10
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not alive(pid)


def start_parent() -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen(
        [sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True, process_group=0
    )
    return proc, int(proc.stdout.readline())


def test_stop_process_reaps_what_a_killed_leader_left():
    proc, child = start_parent()
    proc.send_signal(signal.SIGKILL)  # the leader dies without stopping its child
    time.sleep(0.5)
    assert alive(child)
    assert stop_process(proc, grace_s=5) == -signal.SIGKILL
    assert wait_dead(child)


def test_stop_process_stops_the_leader_and_what_it_started():
    proc, child = start_parent()
    assert stop_process(proc, grace_s=5) == -signal.SIGTERM
    assert wait_dead(child)
