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

from pathlib import Path


def scalars(report: dict) -> dict[str, float]:
    """One step's report as ``{tag: value}``."""
    out: dict[str, float] = {}
    agreement = report.get("agreement", {})
    for kind in ("exact", "overlap"):
        for layer, value in zip(agreement.get("layers", []), agreement.get(kind, []), strict=False):
            out[f"agreement/{kind}/layer_{layer}"] = value
    for name, gap in report.get("gap", {}).items():
        for key in ("mean_abs", "max_abs", "k3_kl", "ratio_gt_2"):
            out[f"gap/{name}/{key}"] = gap[key]
    for epoch, value in enumerate(report.get("update_agreement", [])):
        out[f"update_agreement/epoch_{epoch}"] = value
    simple = {
        "reward/mean": "reward_mean",
        "reward/expected": "expected_reward",
        "loss": "loss",
        "clip_fraction": "clip_fraction",
        "aux_loss": "aux_loss",
        "missing_records": "missing_records",
    }
    for tag, key in simple.items():
        if report.get(key) is not None:
            out[tag] = report[key]
    for key in ("replayed_fraction", "masked_fraction"):
        if key in report.get("rows", {}):
            out[f"rows/{key}"] = report["rows"][key]
    for key, value in report.get("time_s", {}).items():
        out[f"time/{key}"] = value
    return {tag: float(v) for tag, v in out.items()}


class ReportWriter:
    """Writes each step's report scalars to TensorBoard event files in ``log_dir``."""

    def __init__(self, log_dir: str | Path):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(log_dir))

    def write(self, report: dict) -> None:
        step = int(report["step"])
        for tag, value in scalars(report).items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
