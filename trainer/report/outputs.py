"""What the training loop does after each step, one output object each, in the order of
``OUTPUTS``.

The table's order is the rule: the metrics see the step first; the export (and the push to
the rollout servers) comes before the console line, so the line names the new policy
versions; the checkpoint comes after the export; the batch's lost records are logged as dead
letters before the checkpoint, and the feed is acknowledged only after it, so a crash before
it leads to redelivery, never to a batch trained and lost, and a crash after it settles the
dead letters on resume; the records file and the JSON report are written when the run ends.
Each row names the setting that turns the output on and whether only the lead rank runs it
(the export, the dead letters, the checkpoint and the feed's acknowledgement are collectives:
every rank runs them).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from routereplay.domain.record import Record
from routereplay.domain.record_file import save_records
from trainer import checkpoint
from trainer.config import TrainerConfig
from trainer.data.source import FeedPlans
from trainer.distributed.dp import DataParallel
from trainer.model.build import TrainerModel
from trainer.model.export import export_after_step
from trainer.optim import AdamW
from trainer.report.step_report import FeedBatch, StepReport

log = logging.getLogger(__name__)


@dataclass
class Run:
    """What the outputs may use: the run's configuration, model, optimizer and ranks, and the
    ready feed when the batches come from it."""

    config: TrainerConfig
    model: TrainerModel
    optimizer: AdamW  # saved with the checkpoints
    dp: DataParallel
    feed: FeedPlans | None = None


@dataclass
class StepDone:
    """One finished step: its report, its wall time (the wait for its records included), and
    the routes its update passes used (``trainer.rl.stages.StepResult``)."""

    step: int
    report: StepReport
    seconds: float
    routes_used: list[Record]
    dead_letters: list[str] = field(default_factory=list)  # this rank's, to dead-letter


class Output:
    """After each step, when the run ends, and on the way out (also after an error)."""

    def after_step(self, done: StepDone) -> dict[str, Any] | None:
        """Step ``done.step`` is trained. Returns the ``StepReport`` fields this output
        learned (the policy versions a push made, the feed batch acknowledged), which the
        outputs after it and the run's reports see; None when it learned none."""

    def finish(self, last_step: int | None, reports: list[StepReport]) -> None:
        """The run ended; ``last_step`` is None when it ran no step."""

    def close(self) -> None:
        """Release what the output holds (after ``finish``, or after an error)."""


class Metrics(Output):
    """Prometheus (``report.metrics``): the run's figures at ``/metrics``."""

    def __init__(self, run: Run):
        from trainer.report.metrics import TrainerMetrics

        report = run.config.report
        self.metrics = TrainerMetrics().serve_at(report.metrics_host, report.metrics_port)
        log.info("metrics at http://%s:%d/metrics", report.metrics_host, self.metrics.port)

    def after_step(self, done: StepDone) -> None:
        self.metrics.observe(done.report, done.seconds)

    def close(self) -> None:
        self.metrics.stop()


class ExportAndPush(Output):
    """Every ``train.export_every`` steps and after the last, the weights in the Hugging Face
    format (``train.export_dir``); with ``push.targets``, loaded by those rollout servers."""

    def __init__(self, run: Run):
        self.run = run
        self.exported = -1

    def after_step(self, done: StepDone) -> dict[str, Any] | None:
        if (done.step + 1) % self.run.config.train.export_every == 0:
            versions = self._export(done.step, push=True)
            return None if versions is None else {"policy_versions": versions}
        return None

    def finish(self, last_step: int | None, reports: list[StepReport]) -> None:
        if last_step is not None and self.exported != last_step:
            self._export(last_step, push=False)  # no step report left to name the versions

    def _export(self, step: int, push: bool) -> list[int] | None:
        """Export, and with ``push`` load it on the configured rollout servers; their new
        policy versions (None without a push)."""
        run = self.run
        folder = export_after_step(run.model, run.config, step, run.dp)
        self.exported = step
        servers = run.config.push
        if folder is None or not push or not servers.targets:
            return None
        from trainer.policy_sync import push_weights

        versions = push_weights(servers.targets, folder, servers.security())
        log.info("rollout servers now at policy versions %s", versions)
        return versions


class Console(Output):
    """One log line per step."""

    def after_step(self, done: StepDone) -> None:
        log.info("%s", summary(done.report))


class TensorBoard(Output):
    """The report's scalars at the step number (``report.tensorboard_dir``)."""

    def __init__(self, run: Run):
        from trainer.report.tensorboard import ReportWriter

        self.writer = ReportWriter(run.config.report.tensorboard_dir)

    def after_step(self, done: StepDone) -> None:
        self.writer.write(done.report)

    def close(self) -> None:
        self.writer.close()


class Checkpoint(Output):
    """Every ``train.checkpoint_every`` steps and after the last (``train.checkpoint_dir``)."""

    def __init__(self, run: Run):
        self.run = run
        self.saved = -1

    def after_step(self, done: StepDone) -> None:
        if (done.step + 1) % self.run.config.train.checkpoint_every == 0:
            self._save(done.step)

    def finish(self, last_step: int | None, reports: list[StepReport]) -> None:
        if last_step is not None and self.saved != last_step:
            self._save(last_step)

    def _save(self, step: int) -> None:
        run = self.run
        checkpoint.save_step(run.config, run.model, run.optimizer, step, run.dp)
        self.saved = step


class DeadLetters(Output):
    """The batch's samples whose record was gone: each rank fetched its share, so the lead,
    which settles them, learns every rank's, and logs them before the checkpoint
    (``FeedPlans.dead_letter``)."""

    def __init__(self, run: Run):
        self.feed, self.dp = run.feed, run.dp

    def after_step(self, done: StepDone) -> None:
        self.feed.dead_letter(
            sorted({s for part in self.dp.all_gather(done.dead_letters) for s in part})
        )


class FeedAck(Output):
    """The feed's batch acknowledged once trained (and checkpointed when configured); the
    lead's report names its groups and the versions that generated them."""

    def __init__(self, run: Run):
        self.feed, self.lead = run.feed, run.dp.lead

    def after_step(self, done: StepDone) -> dict[str, Any] | None:
        groups = self.feed.ack()
        return {"feed": feed_batch(groups)} if self.lead else None

    def close(self) -> None:
        self.feed.close()


class RecordsFile(Output):
    """The routes used, layout-free, in ``router_replay.record_file`` when the run ends."""

    def __init__(self, run: Run):
        self.path = run.config.router_replay.record_file
        self.used: list[Record] = []

    def after_step(self, done: StepDone) -> None:
        self.used.extend(done.routes_used)

    def finish(self, last_step: int | None, reports: list[StepReport]) -> None:
        save_records(self.path, self.used)


class JsonReport(Output):
    """Every step's report in ``report.json`` when the run ends."""

    def __init__(self, run: Run):
        self.path = Path(run.config.report.json)

    def finish(self, last_step: int | None, reports: list[StepReport]) -> None:
        self.path.write_text(json.dumps([r.as_dict() for r in reports], indent=2))


@dataclass(frozen=True)
class OutputRow:
    make: Callable[[Run], Output]
    enabled: Callable[[Run], object]
    lead_only: bool


# In this order after each step; see the module's docstring for why.
OUTPUTS = (
    OutputRow(Metrics, lambda run: run.config.report.metrics, lead_only=True),
    OutputRow(ExportAndPush, lambda run: run.config.train.export_dir, lead_only=False),
    OutputRow(lambda run: Console(), lambda run: True, lead_only=True),
    OutputRow(TensorBoard, lambda run: run.config.report.tensorboard_dir, lead_only=True),
    OutputRow(DeadLetters, lambda run: run.feed is not None, lead_only=False),
    OutputRow(Checkpoint, lambda run: run.config.train.checkpoint_dir, lead_only=False),
    OutputRow(FeedAck, lambda run: run.feed is not None, lead_only=False),
    OutputRow(RecordsFile, lambda run: run.config.router_replay.record_file, lead_only=True),
    OutputRow(JsonReport, lambda run: run.config.report.json, lead_only=True),
)


def outputs_for(run: Run) -> list[Output]:
    """This rank's outputs, in ``OUTPUTS``' order, as the configuration turns them on."""
    return [
        row.make(run) for row in OUTPUTS if row.enabled(run) and (run.dp.lead or not row.lead_only)
    ]


def summary(report: StepReport) -> str:
    """One console line per step."""
    gap = "  ".join(
        f"gap[{name}] mean {g.mean_abs:.2e} max {g.max_abs:.2e} k3 {g.k3_kl:.1e}"
        for name, g in report.gap.items()
    )
    agree = " ".join(f"{x:.4f}" for x in report.agreement.exact)
    t = report.time_s
    return (
        f"step {report.step} [{report.mode}] reward {report.reward_mean:.3f} "
        f"expected {report.expected_reward:.4f} loss {report.loss:+.4f}  "
        f"routing agreement/layer {agree}  {gap}  "
        f"update agreement {[round(x, 4) for x in report.update_agreement]}  "
        f"replayed rows {report.rows.replayed_fraction:.3f}  "
        f"missing {report.missing_records}  "
        + (f"aux loss {report.aux_loss:.4f}  " if report.aux_loss is not None else "")
        + f"time old {t.old_logprob:.2f}s compare {t.compare:.2f}s update {t.update:.2f}s "
        f"fetch wait {t.fetch_wait:.3f}s"
    )


def feed_batch(groups) -> FeedBatch:
    """What a feed batch was: its groups and the policy versions that generated its turns."""
    versions = {v for group in groups for entry in group.entries for v in entry.policy_versions}
    return FeedBatch(groups=[g.group_id for g in groups], rollout_versions=sorted(versions))
