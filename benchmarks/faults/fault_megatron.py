"""The fault run's real trainer: ``python -m trainer`` itself (megatron-core, 2 data-parallel
gloo ranks under torchrun, R3, the ready feed as the consumer group ``trainer``, a checkpoint
every 3 steps), with taps that write the fault run's history and stop it where the run asks.

Nothing of the trainer is replaced: this module wraps a few of its functions with logging
(``fault_history.History``, the entries ``fault_trainer.py`` writes) and then calls
``trainer.__main__.main`` with the trainer's own arguments. The taps:

- ``resume`` (the lead, once ``FeedPlans`` has read its feed log: the steps the checkpoint
  covers), ``deliver`` (the lead: a batch handed out), ``ack`` (the lead: the samples the feed
  acknowledged, at the resume, after a step, at the end), ``checkpoint``, ``finish``;
- ``step``: every rank logs the samples of its own share and the digest of each record it
  trained on (rank 1 into ``<history>-r1.jsonl``), once the step's update is done;
- ``dead_letter``: every rank, the samples of its share whose record was gone.

Kill points, asked for by creating ``PAUSE_DIR/<point>`` (the lead deletes it, logs ``paused``
and stops itself with SIGSTOP; the other rank blocks in its next collective; the run SIGKILLs
the job's process group): ``mid_step`` (the step's first optimizer step taken, its update
passes not finished), ``after_checkpoint`` (a step checkpointed, not acknowledged),
``after_ack`` (a step acknowledged, not checkpointed).

When ``--stop-file`` exists the feed's next wait ends the run (``data.wait_s``): the trainer
finishes as it does when its feed runs dry, with its final checkpoint and acknowledgement.

Usage: torchrun --standalone --nproc-per-node 2 -m benchmarks.faults.fault_megatron
           --history H --pause-dir D --stop-file F --time-zero T -- TRAINER_ARGS...
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

from benchmarks.faults.fault_history import GEOMETRY, TRAINER, History

BATCH = 16  # samples per step (8 per rank, one micro-batch each)


def command(workdir: Path, target: str, time_zero: float, batch: int = BATCH) -> list[str]:
    """The job: ``torchrun`` of 2 data-parallel gloo ranks running the trainer's main through
    this module on the route cache ``target``'s ready feed, R3 on a tiny model of the fault
    run's record geometry (Qwen3-MoE, layer 0 dense, layers 1-4 MoE, 8 experts, top-2; built
    into ``workdir/model`` once), checkpoints every 3 steps in ``workdir/checkpoints``; the
    history in ``workdir/trainer.jsonl``, kill points in ``workdir/pause``, ``workdir/stop``
    ends it."""
    model = workdir / "model"
    if not model.exists():
        from routereplay.dev.tiny_model import build_tiny_model
        from routereplay.families.base import MoESize

        build_tiny_model(model, size=MoESize(num_hidden_layers=1 + len(GEOMETRY.moe_layers)))
    (workdir / "pause").mkdir(exist_ok=True)
    return [
        *(sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"),
        *("-m", "benchmarks.faults.fault_megatron"),
        *("--history", str(workdir / "trainer.jsonl"), "--pause-dir", str(workdir / "pause")),
        *("--stop-file", str(workdir / "stop"), "--time-zero", repr(time_zero), "--"),
        f"model.path={model}",
        f"model.model_id={GEOMETRY.model_id}",
        f"route_cache.target={target}",
        "router_replay.mode=R3",
        "data.source=feed",
        f"data.consumer_group={TRAINER}",
        "data.wait_s=30",  # no batch for that long: the feed is dry, the job ends
        "parallel.dp=2",
        f"train.batch_size={batch}",
        f"train.micro_batch_size={batch}",
        "train.steps=1000000",
        f"train.checkpoint_dir={workdir / 'checkpoints'}",
        "train.checkpoint_every=3",
    ]


def install(args, history: History, rank: int) -> dict:
    """Wrap the trainer's functions with the taps (see the module's docstring). Returns what
    the taps learn of the run as it goes (``checkpoints``: its checkpoint folder)."""
    from trainer.data import source
    from trainer.optim import AdamW
    from trainer.report import outputs
    from trainer.rl.step import RLStep

    lead = rank == 0
    pause_dir = Path(args.pause_dir)
    state = {"optimizer_steps": 0}

    def pause(point: str, step: int) -> None:
        trigger = pause_dir / point
        if lead and trigger.exists():
            trigger.unlink()
            history.log("paused", point=point, step=step)
            os.kill(os.getpid(), signal.SIGSTOP)  # the run SIGKILLs the job here

    feed_init = source.FeedPlans.__init__

    def init(self, config, dp, client=None):
        feed_init(self, config, dp, client)
        state.update(every=config.train.checkpoint_every, checkpoints=config.train.checkpoint_dir)
        if dp.lead:
            history.log("resume", steps_done=self.step, discarded_steps=self.discarded_steps)
            if self.resumed is not None and self.resumed.entry_samples:
                history.log("ack", samples=self.resumed.entry_samples, ok=True, at_resume=True)

    next_plan = source.FeedPlans.next_plan

    def next_plan_tapped(self):
        if self.dp.lead and Path(args.stop_file).exists():
            self.wait_s = min(self.wait_s, 1.0)  # the run is over: stop once the feed is dry
        plan = next_plan(self)
        if plan is not None and self.dp.lead:
            history.log("deliver", samples=plan.sample_ids, step=self.step - 1)
        return plan

    def close(self):  # the lead's alone hands out: the others' ``handed_out`` stays empty
        with history.acks_of(self):
            close_feed(self)

    close_feed = source.FeedPlans.close
    source.FeedPlans.__init__ = init
    source.FeedPlans.next_plan = next_plan_tapped
    source.FeedPlans.close = close

    optimizer_step = AdamW.step

    def optimizer_step_tapped(self):
        optimizer_step(self)
        state["optimizer_steps"] += 1
        if state["optimizer_steps"] == 1:  # weights moved, the step's update not finished
            pause("mid_step", state["step"])

    AdamW.step = optimizer_step_tapped

    run = RLStep.run

    def run_tapped(self, fetched, step=0):
        state.update(step=step, optimizer_steps=0)
        result = run(self, fetched, step)
        history.log_step(step, fetched)
        return result

    RLStep.run = run_tapped

    save = outputs.Checkpoint._save

    def save_tapped(self, step: int) -> None:
        save(self, step)
        if lead:
            history.log("checkpoint", steps_done=step + 1)

    outputs.Checkpoint._save = save_tapped

    checkpoint_after = outputs.Checkpoint.after_step

    def checkpoint_after_tapped(self, done):
        checkpoint_after(self, done)
        if self.saved == done.step:
            pause("after_checkpoint", done.step)

    outputs.Checkpoint.after_step = checkpoint_after_tapped

    ack_after = outputs.FeedAck.after_step

    def ack_after_tapped(self, done):
        with history.acks_of(self.feed):
            learned = ack_after(self, done)
        if done.dead_letters:  # this rank's share's
            history.log("dead_letter", samples=done.dead_letters, step=done.step)
        if (done.step + 1) % state["every"]:
            pause("after_ack", done.step)
        return learned

    outputs.FeedAck.after_step = ack_after_tapped
    return state


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--history", required=True, help="the lead's JSONL history file")
    parser.add_argument("--pause-dir", required=True)
    parser.add_argument("--stop-file", required=True)
    parser.add_argument("--time-zero", type=float, required=True, help="the run's time zero")
    args = parser.parse_args(argv[:split])
    rank = int(os.environ.get("RANK", "0"))
    path = Path(args.history)
    if rank:
        path = path.with_name(f"{path.stem}-r{rank}{path.suffix}")
    history = History(path, "trainer", args.time_zero)
    from trainer.__main__ import main as trainer_main

    state = install(args, history, rank)
    rc = trainer_main(argv[split + 1 :])
    if rank == 0 and rc == 0:
        from trainer.data.feed_log import steps_checkpointed

        history.log("finish", steps_done=steps_checkpointed(state["checkpoints"]))
    history.close()
    return rc


if __name__ == "__main__":
    sys.exit(main())
