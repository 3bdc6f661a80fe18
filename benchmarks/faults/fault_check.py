"""The fault run's verdict from its history file alone (``bench_faults.py`` writes it).

The history holds every operation, every fault with its component, the final read (turns
held and digest per sample) and the ready feed's final state, so nothing else is needed: no
cluster, no route cache. Prints the same verdict as the run, with the traffic floor per
fault, and the trail of each sample found wrong; exit code 0 only when it passes.

Usage: python -m benchmarks.faults.fault_check results/faults/faults-history.jsonl
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from benchmarks.faults.fault_history import check_file, flagged, load_history, trail


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("history", type=Path)
    args = parser.parse_args(argv)
    verdict, config = check_file(args.history)
    print(f"history: {args.history} (wait_replicas {config.get('wait_replicas')})")
    print("\n".join(verdict.lines()))
    if not verdict.ok:  # the run's logs lie beside its history (bench_faults copies them)
        history = load_history([args.history])
        print("\n".join(trail(history, flagged(verdict), args.history.parent)))
    return 0 if verdict.ok else 1


if __name__ == "__main__":
    sys.exit(main())
