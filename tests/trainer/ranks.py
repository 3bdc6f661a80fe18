"""Each rank of a 2-rank world as its own process, without torchrun's agent.

torchrun stops the other ranks as soon as one fails, so "every rank refuses" cannot be seen
through it. Started independently with the rank environment torchrun would give them, each
rank must fail on its own with the error, and none may hang waiting for a collective.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from routereplay.dev.launch import free_port

ROOT = Path(__file__).resolve().parents[2]


def run_each_rank(args: list[str], world_size: int = 2, timeout: float = 90) -> list[tuple]:
    """Start ``python args...`` once per rank; returns (returncode, stdout, stderr) per rank.

    Raises:
        subprocess.TimeoutExpired: a rank hung (it reached a collective).
    """
    port = str(free_port())
    procs = []
    for rank in range(world_size):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            LOCAL_WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            OMP_NUM_THREADS="1",
            PYTHONPATH=str(ROOT),
        )
        procs.append(
            subprocess.Popen(
                args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    results = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            results.append((proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    return results
