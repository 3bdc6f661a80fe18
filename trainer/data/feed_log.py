"""The feed's position, kept beside the checkpoints: which ready-feed entries each step trained.

A trainer reading the ready feed (``FeedPlans``) must not acknowledge a batch before a
checkpoint covers its step: a job killed after an acknowledged but un-checkpointed step resumes
from the checkpoint before it, with weights that never saw those samples, and the feed, told
they were trained, never offers them again (lost for good). So acknowledgements wait for the
checkpoint. That leaves the other window, a job killed after a checkpoint and before its
acknowledgement: the resumed job would be offered the checkpointed batches again and train
them twice. This log closes it:

``checkpoint_dir/feed.jsonl``, one JSON line per batch handed out, written and fsynced before
the step trains (``{"step", "entries", "samples", "groups"}``), one line per step with samples
whose record was gone, before its checkpoint (``{"dead": step, "entries", "samples"}``: each
of their entries and its sample), and one line per acknowledgement (``{"acked_through":
step}``). A resumed job (``steps_done`` from the checkpoint it loads) acknowledges the entries
of the steps the checkpoint covers and that were not acknowledged yet (settling the dead
letters among them to the dead-letter stream), remembers every sample and group the
checkpoint covers (so later repeats of them are dropped, not trained again), and forgets the
steps the checkpoint does not cover (they were trained and discarded with the weights; their
entries are still pending on the feed and come back to train again).

Delivery, per sample: exactly once in the steps the final weights descend from; a step
trained after the last checkpoint of a killed job is discarded and its samples trained again
(at least once per step executed). The log holds every sample id of the job (about 50 bytes
each).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

NAME = "feed.jsonl"


def steps_checkpointed(checkpoint_dir: str | Path) -> int:
    """The steps the last checkpoint covers: the one ``checkpoint_dir/latest`` names
    (``trainer.checkpoint.mark_latest``: ``step_NNNNNN``, N steps done), 0 when none."""
    marker = Path(checkpoint_dir) / "latest"
    try:
        name = marker.read_text().strip()
    except FileNotFoundError:
        return 0
    return int(name.removesuffix(".pt").split("_", 1)[1])


@dataclass
class Resumed:
    """What the log says at a resume: entries to acknowledge now (a checkpoint covers them,
    no acknowledgement was logged), and every sample and group key the checkpoint covers."""

    entries: list[str] = field(default_factory=list)
    entry_samples: list[str] = field(default_factory=list)  # the samples of ``entries``
    dead: list[tuple[str, str]] = field(default_factory=list)  # of ``entries``: (entry, sample)
    samples: list[str] = field(default_factory=list)
    groups: list[tuple[str, str]] = field(default_factory=list)
    discarded_steps: list[int] = field(default_factory=list)


class FeedLog:
    """``checkpoint_dir/feed.jsonl`` (see the module docstring). The lead's alone."""

    def __init__(self, checkpoint_dir: str | Path):
        self.path = Path(checkpoint_dir) / NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = None

    def resume(self, steps_done: int) -> Resumed:
        """Read the log for a job resuming after ``steps_done`` steps and rewrite it without
        the steps past them (0: a fresh job, the log is emptied)."""
        lines = []
        if self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    lines.append(json.loads(line))
                except ValueError:  # a line cut by the kill: its step never trained
                    continue
        steps = [e for e in lines if "step" in e and e["step"] < steps_done]
        acked = max((e["acked_through"] for e in lines if "acked_through" in e), default=-1)
        acked = min(acked, steps_done - 1)
        found = Resumed()
        for e in steps:
            if e["step"] > acked:
                found.entries += e["entries"]
                found.entry_samples += e["samples"]
            found.samples += e["samples"]
            found.groups += [tuple(g) for g in e["groups"]]
        dead = [e for e in lines if "dead" in e and e["dead"] < steps_done]
        for e in dead:
            if e["dead"] > acked:
                found.dead += list(zip(e["entries"], e["samples"], strict=True))
        found.discarded_steps = sorted(
            {e["step"] for e in lines if e.get("step", -1) >= steps_done}
        )
        kept = steps + dead + ([{"acked_through": acked}] if acked >= 0 else [])
        tmp = self.path.with_name(f".{NAME}.tmp")
        tmp.write_text("".join(json.dumps(e) + "\n" for e in kept))
        os.replace(tmp, self.path)
        return found

    def handed_out(self, step: int, groups) -> None:
        """Step ``step`` trains ``groups`` (``ReadyGroup``s): logged before it does."""
        self._write(
            {
                "step": step,
                "entries": [i for g in groups for i in g.entry_ids],
                "samples": [s for g in groups for s in g.sample_ids],
                "groups": [list(g.key) for g in groups],
            }
        )

    def dead_letters(self, step: int, delivered: list[tuple[str, str]]) -> None:
        """Step ``step``'s samples whose record was gone, as (entry id, sample id) pairs:
        logged before its checkpoint, so a resume settles them as dead letters."""
        entries, samples = [e for e, _ in delivered], [s for _, s in delivered]
        self._write({"dead": step, "entries": entries, "samples": samples})

    def acked(self, through_step: int) -> None:
        """Every batch up to step ``through_step`` is acknowledged on the feed."""
        self._write({"acked_through": through_step})

    def _write(self, entry: dict) -> None:
        if self._file is None:
            self._file = open(self.path, "a")  # noqa: SIM115 - held for the job
        self._file.write(json.dumps(entry) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
