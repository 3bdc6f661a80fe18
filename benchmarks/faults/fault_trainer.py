"""The fault run's trainer: the trainer's own feed path with a stand-in step, as its own process
(the run SIGKILLs it and starts it again, as a supervisor restarts a failed job).

What is the trainer's (``trainer.train``'s order, per step): ``FeedPlans`` (the lead's
``ReadyConsumer`` on its own consumer group, ``trainer``, with the feed log beside the
checkpoints), the records fetched through ``CacheSource`` and checked by ``resolve``,
the step's lost records logged as dead letters (``DeadLetters``), a checkpoint every
``--every`` steps (``trainer.checkpoint.save``: model, optimizer, RNG, step),
then ``FeedPlans.ack`` (``FeedAck``), and at the end the final checkpoint and
``FeedPlans.close``; a restarted process resumes from ``checkpoint.latest`` as ``train`` does.
What stands in: the model (one parameter, the number of steps trained), the step (a digest of
each record and a short sleep), no megatron (its RNG tracker is absent).

Logged (see ``fault_history``): ``resume`` (steps done by the checkpoint loaded), ``deliver``,
``step`` (the step number, its samples and the digests trained on), ``checkpoint``, ``ack``
(the samples acknowledged now), ``paused`` (at a point the run asked for), ``finish``.

The run asks for a kill at a point by creating ``PAUSE_DIR/<point>``: the process deletes it,
logs ``paused`` and stops itself (SIGSTOP) there, and the run SIGKILLs it. Points:
``mid_step`` (a batch fetched, its step not taken), ``after_checkpoint`` (a step trained and
checkpointed, not acknowledged) and ``after_ack`` (a step trained and its acknowledgement
called, not checkpointed).

``--mutate early-ack``: acknowledge every batch once trained, whether or not a checkpoint
covers it (the gap issue 29 found): a kill after the acknowledgement loses samples.
``--mutate no-dead-letter``: a published sample whose record is gone fails its batch (the
rule before issue 47): the trainer crash-loops on it.

Usage: python -m benchmarks.faults.fault_trainer --target T --history H --checkpoint-dir D ...
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.modules.setdefault("megatron", None)  # the stand-in has no megatron: 10-20 s less a start

import torch  # noqa: E402  (after the line above)

from benchmarks.faults.fault_history import History  # noqa: E402
from routereplay.errors import RouteReplayError  # noqa: E402
from routereplay.rpc.client import RetryPolicy, RouteCacheClient  # noqa: E402
from trainer import checkpoint  # noqa: E402
from trainer.config import MissingRecord  # noqa: E402
from trainer.data.source import CacheSource, FeedPlans, resolve  # noqa: E402
from trainer.distributed.dp import SINGLE  # noqa: E402


def pause(args, history: History, point: str, step: int) -> None:
    trigger = Path(args.pause_dir) / point
    if trigger.exists():
        trigger.unlink()
        history.log("paused", point=point, step=step)
        os.kill(os.getpid(), signal.SIGSTOP)  # the run SIGKILLs it here


def run(args) -> int:
    history = History(Path(args.history), "trainer", args.start)
    config = SimpleNamespace(
        data=SimpleNamespace(
            group_size=1,
            wait_s=args.wait_s,
            consumer_group=args.group,
            consumer="trainer",
            start_from_latest=False,
        ),
        train=SimpleNamespace(
            batch_size=args.batch,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_every=args.every,
            resume=True,
        ),
    )
    if args.mutate == "early-ack":
        covered = FeedPlans.ack_covered
        FeedPlans.ack_covered = lambda self, through=None: covered(self, self._reported)
    model = torch.nn.Linear(1, 1, bias=False)
    torch.nn.init.zeros_(model.weight)
    built = SimpleNamespace(model=model)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    found = checkpoint.latest(args.checkpoint_dir)
    start = checkpoint.load(found, built, optimizer) if found is not None else 0
    retry = RetryPolicy(attempts=args.attempts, initial_backoff_s=0.1, max_backoff_s=1.0)
    client = RouteCacheClient(args.target, timeout_s=5, retry=retry)
    source = CacheSource(args.target, timeout_s=5)
    plans = FeedPlans(config, SINGLE, client)
    history.log(
        "resume",
        steps_done=start,
        weight=float(model.weight.item()),
        discarded_steps=plans.discarded_steps,
    )
    assert plans.step == start, (plans.step, start)
    if plans.resumed is not None and plans.resumed.entry_samples:  # acknowledged at the resume
        history.log("ack", samples=plans.resumed.entry_samples, ok=True, at_resume=True)
    step = start
    while True:
        try:
            plan = plans.next_plan()
        except RouteReplayError as exc:
            history.log("poll", ok=False, status=exc.status)
            time.sleep(0.2)
            continue
        if plan is None:
            if Path(args.stop_file).exists():
                break
            continue
        history.log("deliver", samples=plan.sample_ids, step=step)
        if args.mutate == "no-dead-letter":  # the old rule: a lost record fails the batch
            plan.published = False
        for tries in range(100):  # a failed fetch is retried: the step has not happened yet
            try:
                fetched = resolve(plan, source.fetch(plan.sample_ids), MissingRecord.ERROR)
                break
            except RouteReplayError as exc:
                history.log("fetch", ok=False, status=exc.status)
                if tries == 99:
                    raise
                time.sleep(0.2)
        pause(args, history, "mid_step", step)  # fetched, not trained
        time.sleep(args.step_s)
        with torch.no_grad():
            model.weight += 1.0  # the stand-in update: the weights count the steps trained
        if fetched.dead_letters:  # records lost: trained nothing, settled as dead letters
            history.log("dead_letter", samples=fetched.dead_letters, step=step)
        plans.dead_letter(fetched.dead_letters)  # ``DeadLetters``: logged before the checkpoint
        history.log_step(step, fetched)
        if (step + 1) % args.every == 0:
            checkpoint.save(args.checkpoint_dir, step + 1, built, optimizer)
            history.log("checkpoint", steps_done=step + 1)
            pause(args, history, "after_checkpoint", step)
        ack(plans, history)
        if (step + 1) % args.every:
            pause(args, history, "after_ack", step)
        step += 1
    if step > start and step % args.every:
        checkpoint.save(args.checkpoint_dir, step, built, optimizer)
        history.log("checkpoint", steps_done=step)
    with history.acks_of(plans):
        plans.close()
    history.log("finish", steps_done=step, weight=float(model.weight.item()))
    history.close()
    source.close()
    return 0


def ack(plans: FeedPlans, history: History) -> None:
    """``FeedAck.after_step``: ``plans.ack()``, retried while the route cache is down; logs
    the samples it acknowledged."""
    first = True
    with history.acks_of(plans):
        while True:
            try:
                if first:
                    first = False
                    plans.ack()
                else:  # the step was reported; its acknowledgement failed: acknowledge again
                    plans.ack_covered(plans._reported if plans.log is None else None)
                break
            except RouteReplayError as exc:
                history.log("ack", samples=[], ok=False, status=exc.status)
                time.sleep(0.2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", required=True)
    parser.add_argument("--group", default="trainer")
    parser.add_argument("--history", required=True)
    parser.add_argument("--checkpoint-dir", required=True)
    parser.add_argument("--pause-dir", required=True)
    parser.add_argument("--stop-file", required=True)
    parser.add_argument("--start", type=float, required=True, help="the run's time zero")
    parser.add_argument("--batch", type=int, default=1, help="samples per step")
    parser.add_argument("--every", type=int, default=3, help="train.checkpoint_every")
    parser.add_argument("--step-s", type=float, default=0.05, help="the stand-in step's time")
    parser.add_argument("--wait-s", type=float, default=1.0, help="data.wait_s")
    parser.add_argument("--attempts", type=int, default=12)
    parser.add_argument("--mutate", choices=["", "early-ack", "no-dead-letter"], default="")
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
