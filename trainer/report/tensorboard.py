"""The consistency report in TensorBoard (``report.tensorboard_dir``).

``scalars(report)`` flattens one step's report into TensorBoard tags; ``ReportWriter`` writes
them with ``torch.utils.tensorboard.SummaryWriter`` at the step number. Tags:

- ``agreement/exact/layer_L``, ``agreement/overlap/layer_L``: per MoE layer (global number L),
  the fraction of tokens whose trainer-natural top-k equals the rollout's, and the mean overlap;
- ``gap/{natural,replayed}/{mean_abs,max_abs,k3_kl,ratio_gt_2}``: trainer against rollout
  log-probs, without and with replay, same step;
- ``update_agreement/epoch_E``: natural top-k in PPO epoch E against the routes used;
- ``reward/mean``, ``reward/expected``, ``loss``, ``clip_fraction``, ``aux_loss`` (when on),
  ``rows/replayed_fraction``, ``rows/masked_fraction``, ``missing_records``;
- ``time/{fetch,fetch_wait,align,old_logprob,compare,update,step}`` in seconds.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from trainer.report.step_report import StepReport


def scalars(report: StepReport) -> dict[str, float]:
    """One step's report as ``{tag: value}``."""
    out: dict[str, float] = {}
    agreement = report.agreement
    for kind, values in (("exact", agreement.exact), ("overlap", agreement.overlap)):
        for layer, value in zip(agreement.layers, values, strict=False):
            out[f"agreement/{kind}/layer_{layer}"] = value
    for name, gap in report.gap.items():
        for key in ("mean_abs", "max_abs", "k3_kl", "ratio_gt_2"):
            out[f"gap/{name}/{key}"] = getattr(gap, key)
    for epoch, value in enumerate(report.update_agreement):
        out[f"update_agreement/epoch_{epoch}"] = value
    out["reward/mean"] = report.reward_mean
    out["reward/expected"] = report.expected_reward
    out["loss"] = report.loss
    out["clip_fraction"] = report.clip_fraction
    if report.aux_loss is not None:
        out["aux_loss"] = report.aux_loss
    out["missing_records"] = report.missing_records
    out["rows/replayed_fraction"] = report.rows.replayed_fraction
    out["rows/masked_fraction"] = report.rows.masked_fraction
    for key, value in asdict(report.time_s).items():
        out[f"time/{key}"] = value
    return {tag: float(v) for tag, v in out.items()}


class ReportWriter:
    """Writes each step's report scalars to TensorBoard event files in ``log_dir``."""

    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, report: StepReport) -> None:
        step = report.step
        for tag, value in scalars(report).items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
