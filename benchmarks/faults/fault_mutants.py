"""Route cache processes for the fault run (``bench_faults.py``): the route cache with the run's
hook, and with a guarantee removed for the mutations (the run must fail against each).

``hooks`` (always): the point between a consumer's settle claim and its acknowledgement, which
the run kills consumer c0 at (the ``consumer_kill_between`` fault). When the file
``$RR_FAULT_HOOK_DIR/between`` exists, the next acknowledgement by c0 removes it, creates
``between.held``, waits (at most 30 s) until the run has killed c0 and removed that file, and
fails UNAVAILABLE: the consumer died there, and nothing after that point happened. In the
route cache as it is, the claim and the XACK are one script (``ReadyFeed.ack``), so the point
lies before both; in ``claim-apart`` it lies between them.

``early-ack``: a new record's commit (the script that makes the staged record the record) is
deferred 1 s to a background thread and the write is acknowledged at once, before the store
confirms it. A route cache killed in that second, or a Redis master failing, loses writes it
acknowledged.

``claim-apart``: the design before issue 47: the claim is one command, the XACK another (then
on two shards), with the hook's point between them. A consumer killed there leaves its claim
without its XACK: a stand-by that takes the entry over is told "taken", and nobody trains it.

Usage: python -m benchmarks.faults.fault_mutants hooks[,early-ack|,claim-apart]
    [route cache flags...]
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path

DEFER_S = 1.0
HOOK_DIR_ENV = "RR_FAULT_HOOK_DIR"
HOOKED_CONSUMER = "c0"


def between(consumer: str) -> None:
    """The hook's point: where the run asked for it, hold c0's acknowledgement until the run
    killed c0, then fail it (nothing after the point happens)."""
    from routereplay.errors import Unavailable

    folder = os.environ.get(HOOK_DIR_ENV)
    if consumer != HOOKED_CONSUMER or not folder:
        return
    trigger, held = Path(folder) / "between", Path(folder) / "between.held"
    try:
        trigger.unlink()
    except FileNotFoundError:
        return
    held.touch()
    deadline = time.monotonic() + 30
    while held.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    raise Unavailable("the fault run killed the consumer between its claim and its XACK")


def hooks() -> None:
    """Patch ``ReadyFeed.ack``: the hook's point comes first (claim and XACK are one script)."""
    from route_cache.feed import ReadyFeed

    ack = ReadyFeed.ack

    def hooked(self, group, entry_ids, consumer="", *args, **kwargs):
        between(consumer)
        return ack(self, group, entry_ids, consumer, *args, **kwargs)

    ReadyFeed.ack = hooked


def claim_apart() -> None:
    """Patch ``ReadyFeed.ack`` into the old design: the script claims without its XACK, the
    hook's point follows, then the XACK as a command of its own. A named consumer's count
    comes from its claim (``ReadyFeed.ack``), so the answer is the same when nothing fails."""
    from route_cache import feed as feed_module
    from route_cache.feed import ReadyFeed

    xack = "local acked = redis.call('XACK', stream, group, entry)"
    assert xack in feed_module._SETTLE, "the settle script changed: update the mutant"
    feed_module._SETTLE = feed_module._SETTLE.replace(xack, "local acked = 0")
    ack = ReadyFeed.ack

    def apart(self, group, entry_ids, consumer="", *args, **kwargs):
        settled = ack(self, group, entry_ids, consumer, *args, **kwargs)  # the claims alone
        between(consumer)
        self.client.xack(self.stream, group, *entry_ids)
        return settled

    ReadyFeed.ack = apart


def early_ack() -> None:
    """Patch ``RouteStore.write`` to acknowledge before its commit."""
    from route_cache import store as store_module

    write = store_module.RouteStore.write

    # Whatever ``write`` takes (a fixed signature broke silently when it gained
    # ``announcement``: every write then failed INTERNAL, and the run failed for that instead).
    def acknowledged_early(self, *args, **kwargs) -> bool:
        def later() -> None:
            time.sleep(DEFER_S)
            write(self, *args, **kwargs)

        threading.Thread(target=later, daemon=True).start()
        return False  # "stored, not a duplicate", before anything is stored

    store_module.RouteStore.write = acknowledged_early


PATCHES = {"hooks": hooks, "early-ack": early_ack, "claim-apart": claim_apart}


def main() -> int:
    names, *flags = sys.argv[1:]
    chosen = names.split(",")
    if "claim-apart" in chosen and "hooks" in chosen:
        chosen.remove("hooks")  # claim-apart places the hook itself, between its two commands
    for name in chosen:
        PATCHES[name]()
    from route_cache.__main__ import main as route_cache_main

    return route_cache_main(flags)


if __name__ == "__main__":
    sys.exit(main())
