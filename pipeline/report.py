"""The main job's report: what each replay mode did to the training-inference gap, printed and
drawn as one PNG figure."""

from __future__ import annotations

from pathlib import Path

import numpy as np

MODES = ("disabled", "R3", "R2")


def mode_lines(mode: str, steps: list[dict]) -> list[str]:
    lines = []
    for s in steps:
        agree = " ".join(f"{x:.2%}" for x in s["agreement"]["exact"])
        gaps = ", ".join(
            f"{name} routing: mean {g['mean_abs']:.2e} max {g['max_abs']:.2e}"
            for name, g in sorted(s["gap"].items())
        )
        lines.append(
            f"  {mode:8s} step {s['step']}: reward {s['reward_mean']:.3f}, loss "
            f"{s['loss']:+.4f}, natural routing = rollout's on {agree} of tokens per layer; "
            f"log-prob gap to the rollout with {gaps}; replayed rows "
            f"{s['rows']['replayed_fraction']:.0%}"
        )
    return lines


def figure(reports: dict[str, list[dict]], out: Path) -> Path:
    """Per-layer agreement, the gap with and without replay, and reward per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    first = reports[MODES[0]][0]
    layers = first["agreement"]["layers"]
    x = np.arange(len(layers))
    exact = first["agreement"]["exact"]
    axes[0].bar(x, exact, 0.6)
    axes[0].set(title="trainer's natural top-k = rollout's", xlabel="MoE layer",
                xticks=x, xticklabels=layers, ylim=(min(exact) - 0.02, 1.0))  # fmt: skip
    names = ["natural", "replayed"]
    for i, name in enumerate(names):
        means = [reports[m][0]["gap"].get(name, {}).get("mean_abs", np.nan) for m in MODES]
        maxes = [reports[m][0]["gap"].get(name, {}).get("max_abs", np.nan) for m in MODES]
        pos = np.arange(len(MODES)) + (i - 0.5) * 0.35
        axes[1].bar(pos, maxes, 0.35, alpha=0.35, color=f"C{i}")
        axes[1].bar(
            pos, means, 0.35, label=f"{name} routing (bar: mean, shade: max)", color=f"C{i}"
        )
    axes[1].set(title="|log p trainer - log p rollout|, step 0", yscale="log",
                xticks=range(len(MODES)), xticklabels=MODES)  # fmt: skip
    axes[1].legend(fontsize=8)
    for mode in MODES:
        steps = reports[mode]
        axes[2].plot([s["step"] for s in steps], [s["expected_reward"] for s in steps], "o-",
                     label=mode)  # fmt: skip
    axes[2].set(title="expected reward per step", xlabel="step")
    axes[2].legend()
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
