"""A local Ray node for the verl integration's tests and benchmark (verl's environment only).

Ray gives a new node's raylet a fixed 30 s to register with its GCS (hard-coded in
``ray/_private/node.py``; no setting changes it), and the raylet registers only once its
dashboard agent, a Python process with a heavy import, is up. On a loaded 2-core machine that
start has missed the deadline (CI: the first start of a fresh environment right after the main
suite), so the node is started again.
"""

from __future__ import annotations

import warnings

RAY_STARTS = 3


def start_local_ray(**init_kwargs):
    """``ray.init(**init_kwargs)``, up to ``RAY_STARTS`` times while the node misses its
    start-up deadline (a warning each time); any other error is raised at once. Returns the
    ``ray`` module."""
    import psutil
    import ray

    me = psutil.Process()
    for start in range(1, RAY_STARTS):
        before = {child.pid for child in me.children(recursive=True)}
        try:
            ray.init(**init_kwargs)
            return ray
        except Exception as exc:
            if "timed out during startup" not in str(exc):
                raise
            # The failed node's processes (GCS, raylet, agents) are this process's new
            # children: nothing else on the machine is touched.
            for child in me.children(recursive=True):
                if child.pid not in before:
                    child.kill()
            warnings.warn(f"Ray's node missed its start-up deadline (try {start})", stacklevel=2)
    ray.init(**init_kwargs)
    return ray
