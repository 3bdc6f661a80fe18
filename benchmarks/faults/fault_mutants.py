"""Route cache processes with a guarantee removed, for the fault run's mutations
(``bench_faults.py --mutate``): the run must fail against each.

``early-ack``: a new record's commit (the script that makes the staged record the record) is
deferred 1 s to a background thread and the write is acknowledged at once, before the store
confirms it. A route cache killed in that second, or a Redis master failing, loses writes it
acknowledged.

Usage: python -m benchmarks.faults.fault_mutants early-ack [route cache flags...]
"""

from __future__ import annotations

import sys
import threading
import time

DEFER_S = 1.0


def early_ack() -> None:
    """Patch ``RouteStore.write`` to acknowledge before its commit."""
    from route_cache import store as store_module

    write = store_module.RouteStore.write

    def acknowledged_early(self, sample_id, group_id, geometry, block) -> bool:
        def later() -> None:
            time.sleep(DEFER_S)
            write(self, sample_id, group_id, geometry, block)

        threading.Thread(target=later, daemon=True).start()
        return False  # "stored, not a duplicate", before anything is stored

    store_module.RouteStore.write = acknowledged_early


def main() -> int:
    mutation, *flags = sys.argv[1:]
    {"early-ack": early_ack}[mutation]()
    from route_cache.__main__ import main as route_cache_main

    return route_cache_main(flags)


if __name__ == "__main__":
    sys.exit(main())
