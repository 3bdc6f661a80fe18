"""The trainer's feed path (``FeedPlans``) across a killed job: acknowledged only what a
checkpoint covers, and the checkpointed batches acknowledged on resume (``feed_log``).

A job is the training loop's feed calls in their order (``trainer.train``: the batch, the
step, the checkpoint every ``checkpoint_every`` steps, then ``FeedAck``'s ``ack``), killed
at one of three points: after a step (before its checkpoint), after a checkpoint (before its
acknowledgement), after an acknowledgement (before the next checkpoint). The weights are the
list of batches trained since the start; a checkpoint saves it, a resume restores it. Every
sample must be in exactly one of the final weights' steps, and nothing left pending.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from routereplay.domain.feed import ReadyEntry, ReadyPage
from trainer.data.source import FeedPlans
from trainer.distributed.dp import SINGLE


class StreamFeed:
    """A Redis stream with one consumer group, in memory: a read with cursor "0" returns the
    consumer's pending entries, else new ones (then pending); an acknowledgement counts the
    entries it took off the pending list."""

    def __init__(self, samples):
        self.entries = [ReadyEntry(f"{i + 1}-0", s, "", 8) for i, s in enumerate(samples)]
        self.next = 0
        self.pending: dict[str, ReadyEntry] = {}

    def read_ready(self, consumer_group, consumer, max_entries=256, pending_cursor="", **kw):
        if pending_cursor == "0":
            return ReadyPage(sorted(self.pending.values(), key=lambda e: int(e.entry_id[:-2])))
        new = self.entries[self.next : self.next + max_entries]
        self.next += len(new)
        self.pending.update((e.entry_id, e) for e in new)
        return ReadyPage(new)

    def ack_ready(self, consumer_group, entry_ids, consumer="", sample_ids=()):
        return sum(self.pending.pop(i, None) is not None for i in entry_ids)


def config(checkpoint_dir, every):
    return SimpleNamespace(
        data=SimpleNamespace(
            group_size=1, wait_s=0.05, consumer_group="g", consumer="trainer",
            start_from_latest=False,
        ),
        train=SimpleNamespace(
            batch_size=2,
            checkpoint_dir=str(checkpoint_dir) if checkpoint_dir else None,
            checkpoint_every=every,
            resume=True,
        ),
    )  # fmt: skip


class Job:
    """One process of the training job; ``checkpoints`` (steps done -> the weights' batches)
    outlives it, as the checkpoint files do."""

    def __init__(self, feed, checkpoint_dir, every, checkpoints):
        from trainer import checkpoint

        self.mark = checkpoint.mark_latest
        self.dir, self.every, self.checkpoints = checkpoint_dir, every, checkpoints
        self.plans = FeedPlans(config(checkpoint_dir, every), SINGLE, client=feed)
        start = self.plans.step
        self.weights = list(checkpoints.get(start, []))  # the resume: the checkpoint's
        self.executed: list[list[str]] = []

    def save(self, steps_done):
        self.checkpoints[steps_done] = list(self.weights)
        self.mark(self.dir, steps_done)

    def run(self, steps, kill=None) -> bool:
        """Train up to ``steps`` steps; False when killed at ``kill`` = (point, step)."""
        step = self.plans.step
        while step < steps and (plan := self.plans.next_plan()) is not None:
            self.weights.append(plan.sample_ids)
            self.executed.append(plan.sample_ids)
            if kill == ("after_step", step):
                return False
            if (step + 1) % self.every == 0:
                self.save(step + 1)
            if kill == ("after_checkpoint", step):
                return False
            self.plans.ack()
            if kill == ("after_ack", step):
                return False
            step += 1
        self.save(step)  # Checkpoint.finish
        self.plans.close()  # FeedAck.close
        return True


@pytest.mark.parametrize(
    "kill",
    [("after_step", 2), ("after_checkpoint", 3), ("after_ack", 2), ("after_ack", 3)],
)
def test_a_killed_job_trains_every_sample_once_in_its_final_weights(tmp_path, kill):
    samples = [f"s{i}" for i in range(12)]
    feed, checkpoints = StreamFeed(samples), {}
    first = Job(feed, tmp_path, 2, checkpoints)
    assert not first.run(6, kill)
    second = Job(feed, tmp_path, 2, checkpoints)
    assert second.run(6)
    trained = [s for batch in second.weights for s in batch]
    assert sorted(trained) == sorted(samples), second.weights  # each once, none lost
    assert not feed.pending
    executed = len(first.executed) + len(second.executed)
    discarded = executed - len(second.weights)
    # Steps after the last checkpoint die with the killed job's weights: after step 2 (the
    # checkpoint is after step 1), step 2 is trained again; after step 3's checkpoint none is.
    assert discarded == {2: 1, 3: 0}[kill[1]]
    assert second.plans.discarded_steps == ([2] if kill[1] == 2 else [])


def test_without_checkpoints_each_batch_is_acknowledged_once_trained(tmp_path):
    feed = StreamFeed(["a", "b", "c", "d"])
    plans = FeedPlans(config(None, 1), SINGLE, client=feed)
    plans.next_plan()
    assert len(feed.pending) == 4 and plans.ack() and len(feed.pending) == 2


class LostEntryFeed(StreamFeed):
    """The stream's master fails over after s1's first entry (2-0) was read from it: the
    promoted replica never had it, so its acknowledgement takes nothing off the pending list,
    and the writer's retry announced s1 again (5-0)."""

    def read_ready(self, consumer_group, consumer, max_entries=256, pending_cursor="", **kw):
        if not self.failed_over:  # the repeat is announced after the failover, not before
            max_entries = min(max_entries, 4 - self.next)
        return super().read_ready(consumer_group, consumer, max_entries, pending_cursor, **kw)

    failed_over = False

    def ack_ready(self, consumer_group, entry_ids, consumer="", sample_ids=()):
        self.failed_over = True
        self.pending.pop("2-0", None)
        return super().ack_ready(consumer_group, entry_ids, consumer, sample_ids)


def test_a_sample_whose_settle_found_its_entry_lost_is_not_trained_again(tmp_path):
    """Found by the seeded soak (seed 2, the WAIT-only fault on the stream's shard): the
    trainer trained s1, checkpointed, and its settle came back "not settled" (the entry was
    lost); it did not remember s1, and trained the repeat in a later committed step."""
    feed, checkpoints = LostEntryFeed(["s0", "s1", "s2", "s3", "s1", "s4"]), {}
    job = Job(feed, tmp_path, 1, checkpoints)
    job.run(4)
    trained = [s for batch in job.weights for s in batch]
    assert trained.count("s1") == 1, job.weights
