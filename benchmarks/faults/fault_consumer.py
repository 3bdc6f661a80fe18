"""A ready-feed consumer of the fault run, as its own process (the run SIGSTOPs it).

It reads whole samples from the feed (``ReadyConsumer``), fetches their records, "trains" (a
stand-in step: a digest of the bytes and a short sleep), acknowledges them
(``ReadyConsumer.settle``), and commits the samples it settled (a ``train`` line in its
history, flushed); a sample another consumer settled first is dropped as a duplicate. Every
step is logged (see ``fault_history``). It stops when the stop file appears and the feed has
nothing more for it.

``--commit-before-settle``, a mutation the fault run must catch: commit a step's samples
before settling them, so a consumer stopped while it holds a batch commits samples another
consumer claimed and trained meanwhile.

``--drop-ack-step N``, the deliberate failure: step N commits without acknowledging, so its
samples stay pending, another consumer claims them once idle, and trains them again.

Usage: python -m benchmarks.faults.fault_consumer --target T --name c0 --history H --stop-file F
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from benchmarks.faults.fault_history import History, digest
from routereplay.domain.record import Record
from routereplay.errors import RouteReplayError
from routereplay.rpc.client import RetryPolicy, RouteCacheClient
from routereplay.rpc.ready import ReadyConsumer


def train(client: RouteCacheClient, history: History, sample_ids: list[str], step_s: float):
    """The stand-in step: fetch the records and digest them (what a step would train on)."""
    records = {
        r.sample_id: r
        for r in client.read_batch(sample_ids, skip_missing=True)
        if isinstance(r, Record)
    }
    time.sleep(step_s)
    return {
        s: (digest(records[s]), len(records[s].turns)) if s in records else ("missing", 0)
        for s in sample_ids
    }


def commit(history: History, trained: dict, sample_ids: list[str]) -> None:
    """The step's commit: what it trained on, logged (flushed) for the checker."""
    for sample_id in sample_ids:
        found, turns = trained[sample_id]
        history.log("train", sample=sample_id, digest=found, turns=turns)


def run(args) -> int:
    history = History(Path(args.history), args.name, args.start)
    retry = RetryPolicy(attempts=args.attempts, initial_backoff_s=0.1, max_backoff_s=1.0)
    client = RouteCacheClient(args.target, timeout_s=5, retry=retry)
    consumer = ReadyConsumer(
        client,
        args.group,
        args.name,
        group_size=1,
        max_entries=64,
        block_ms=500,
        claim_idle_ms=args.claim_idle_ms,
    )
    steps = 0
    idle_since = None
    while True:
        duplicates = consumer.duplicates
        try:
            groups = consumer.next_groups(args.batch, timeout_s=0.5)
        except RouteReplayError as exc:
            history.log("poll", ok=False, status=exc.status)
            time.sleep(0.2)
            continue
        if consumer.duplicates > duplicates:
            history.log("duplicate", samples=[], count=consumer.duplicates - duplicates)
        if not groups:
            if Path(args.stop_file).exists():
                idle_since = idle_since or time.monotonic()
                if time.monotonic() - idle_since > args.drain_idle_s:
                    break
            continue
        idle_since = None
        sample_ids = [s for g in groups for s in g.sample_ids]
        history.log("deliver", samples=sample_ids, entries=[e for g in groups for e in g.entry_ids])
        while True:  # a failed fetch is retried: the step has not happened yet
            try:
                trained = train(client, history, sample_ids, args.step_s)
                break
            except RouteReplayError as exc:
                history.log("fetch", ok=False, status=exc.status)
                time.sleep(0.2)
        steps += 1
        if steps == args.drop_ack_step:  # the deliberate failure: commit, never acknowledge
            commit(history, trained, sample_ids)
            history.log("dropped_ack", samples=sample_ids)
            continue
        if args.commit_before_settle:  # the mutation: commit first, then settle
            commit(history, trained, sample_ids)
        won = []
        for group in groups:  # one at a time: a failed call is retried for its group only
            while True:
                try:
                    won += consumer.settle([group])
                    history.log("settle", samples=group.sample_ids, entries=group.entry_ids)
                    break
                except RouteReplayError as exc:
                    history.log("ack", samples=group.sample_ids, ok=False, status=exc.status)
                    time.sleep(0.2)
        settled = [s for g in won for s in g.sample_ids]
        history.log("ack", samples=settled, ok=True)
        if not args.commit_before_settle:
            commit(history, trained, settled)
        taken = [s for s in sample_ids if s not in settled]
        if taken:
            history.log("duplicate", samples=taken, taken=True)
    history.log("exit", steps=steps)
    history.close()
    client.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--group", default="faultrun")
    parser.add_argument("--history", required=True)
    parser.add_argument("--stop-file", required=True)
    parser.add_argument("--start", type=float, required=True, help="the run's time zero")
    parser.add_argument("--batch", type=int, default=4, help="samples per step")
    parser.add_argument("--step-s", type=float, default=0.05, help="the stand-in step's time")
    parser.add_argument("--claim-idle-ms", type=int, default=3000)
    parser.add_argument("--attempts", type=int, default=12)
    parser.add_argument("--drain-idle-s", type=float, default=2.0)
    parser.add_argument("--drop-ack-step", type=int, default=0, help="skip this step's ack")
    parser.add_argument(
        "--commit-before-settle",
        action="store_true",
        help="a mutation: commit each step before settling it (a stalled consumer then "
        "commits samples another one claimed and trained)",
    )
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
