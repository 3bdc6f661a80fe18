"""The stability run's per-step records: made from the trainer's step reports, checked, and
summarised into the table and figure of docs/benchmarks.md (``bench_stability.py``).

Torch-free and service-free, so the checks and the summaries run anywhere on the JSON alone
(``python -m benchmarks.stability.bench_stability --from-records FILE``).

**The records file** (JSON): ``plan`` (what was asked: families, seeds, steps per run, the
learning rate, the collapse probe's rates), ``runs`` (one per family, variant, seed and
learning rate: its settings, ``steps_planned`` and ``steps``, one record per RL step) and
``probe`` (the collapse probe's verdicts). A step's record (``step_record``):

- ``kl``: the k3 estimate of KL(rollout || trainer), mean(exp(d) - 1 - d) with d = log p_trainer
  - log p_rollout, over the step's generated tokens, in the pass whose log-probs PPO uses as the
  old policy's (natural routing in ``disabled`` and R2, the rollout's routes replayed in R3):
  the training-inference mismatch of the policy being trained. ``max_gap``: the largest |d|;
  ``mean_gap``: mean |d|; ``ratio_gt_2``: the fraction of tokens with |d| > ln 2.
- ``other_kl`` / ``other_max_gap``: the same from the step's comparison pass, the same weights
  with the other routing (``disabled`` and R2: the rollout's routes replayed; R3: natural).
- ``agreement``: per MoE layer, the fraction of generated and prompt rows whose natural top-k
  set (the trainer's own routing) equals the rollout's; ``overlap``: the shared fraction.
- ``clip_fraction`` (PPO, mean over the step's mini-batch steps), ``grad_norm`` (the L2 norm of
  each optimizer step's gradient), ``reward`` (mean reward of the batch), ``expected_reward``
  (the policy's probability of the rewarded class at the generated positions), ``entropy``,
  ``loss``, ``update_agreement``, ``replay_followed`` (R3).
- ``rollout_versions`` (the policy versions that generated the batch) and ``policy_versions``
  (what the rollout server loaded after the step): the run is on-policy when each step's batch
  comes from the previous step's push, which ``check`` verifies.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# (mode, trainer dtype) and its label: the modes in bf16 against the float32 rollout, then R3
# with a float32 trainer (what is left once routing and precision agree: the kernels' residue).
VARIANTS = (
    ("disabled", "bfloat16"),
    ("R2", "bfloat16"),
    ("R3", "bfloat16"),
    ("R3", "float32"),
)
LABELS = {
    ("disabled", "bfloat16"): "disabled",
    ("R2", "bfloat16"): "R2",
    ("R3", "bfloat16"): "R3",
    ("R3", "float32"): "R3, fp32 trainer",
}
PROBE_MODES = ("disabled", "R2", "R3")
# The last steps the table's medians are taken over (fewer when a run is shorter).
WINDOW = 20
# The R3 paper's training-inference KL (Qwen3-30B-A3B, MoE) and a dense model's (Qwen3-8B):
# the level the paper's MoE would reach with routing mismatch gone.
PAPER_MOE_KL = 1.535e-3
PAPER_DENSE_KL = 6.4e-4
TARGET_R3_RATIO = 0.5
# The collapse probe: a run "runs away" when the median KL or gradient norm of its last
# RUNAWAY_STEPS steps is RUNAWAY_FACTOR times that of its first RUNAWAY_STEPS, or a value is
# not finite.
RUNAWAY_STEPS = 5
RUNAWAY_FACTOR = 10.0

FIELDS = ("kl", "max_gap", "agreement", "clip_fraction", "grad_norm", "reward")


def trained_routing(mode: str) -> str:
    """The report's gap whose log-probs PPO uses as the old policy's in ``mode``."""
    return "replayed" if mode == "R3" else "natural"


def step_record(report: dict[str, Any]) -> dict[str, Any]:
    """One step's record from the trainer's report of it (``StepReport.as_dict``)."""
    mine = trained_routing(report["mode"])
    other = "natural" if mine == "replayed" else "replayed"
    gap = report["gap"][mine]
    other_gap = report["gap"].get(other)
    followed = report.get("replay_followed")
    feed = report.get("feed") or {}
    return {
        "step": report["step"],
        "kl": gap["k3_kl"],
        "max_gap": gap["max_abs"],
        "mean_gap": gap["mean_abs"],
        "ratio_gt_2": gap["ratio_gt_2"],
        "tokens": gap["tokens"],
        "other_kl": other_gap["k3_kl"] if other_gap else None,
        "other_max_gap": other_gap["max_abs"] if other_gap else None,
        "agreement": report["agreement"]["exact"],
        "overlap": report["agreement"]["overlap"],
        "layers": report["agreement"]["layers"],
        "clip_fraction": report["clip_fraction"],
        "grad_norm": report.get("grad_norm"),
        "reward": report["reward_mean"],
        "expected_reward": report["expected_reward"],
        "entropy": report["entropy"],
        "loss": report["loss"],
        "update_agreement": report["update_agreement"],
        "replay_followed": followed["exact"] if followed else None,
        "samples": report["samples"],
        "rollout_versions": feed.get("rollout_versions"),
        "policy_versions": report.get("policy_versions"),
    }


def run_key(run: dict[str, Any]) -> tuple:
    return (run["kind"], run["family"], run["mode"], run["dtype"], run["seed"], run["lr"])


def expected_runs(plan: dict[str, Any]) -> list[tuple]:
    """The main runs the plan asks for (``run_key``'s form): every variant per family and
    seed, R3 with a float32 trainer for the first ``fp32_seeds`` seeds only; the probe's runs
    depend on what it finds and are checked from its own verdicts."""
    fp32_seeds = plan.get("fp32_seeds", len(plan["seeds"]))
    return [
        ("main", family, mode, dtype, seed, plan["lr"])
        for seed in plan["seeds"]
        for family in plan["families"]
        for mode, dtype in VARIANTS
        if dtype != "float32" or seed in plan["seeds"][:fp32_seeds]
    ]


def _finite(value) -> bool:
    if value is None:
        return False
    if isinstance(value, list):
        return bool(value) and all(_finite(v) for v in value)
    return isinstance(value, int | float) and math.isfinite(value)


def check_run(run: dict[str, Any]) -> list[str]:
    """What is wrong with one run's records: missing or repeated steps, a figure missing or
    not finite (a probe run may go non-finite: that is its finding, not a fault), a batch not
    generated by the policy the previous step pushed."""
    name = run_name(run)
    problems = []
    steps = [s["step"] for s in run["steps"]]
    planned = run["steps_planned"]
    if steps != list(range(planned)):
        missing = sorted(set(range(planned)) - set(steps))
        extra = len(steps) - len(set(steps))
        problems.append(
            f"{name}: {len(steps)} step records for {planned} planned steps"
            + (f"; missing steps {_ranges(missing)}" if missing else "")
            + (f"; {extra} repeated" if extra else "")
            + ("" if missing or extra else "; out of order")
        )
    for s in run["steps"]:
        for field in FIELDS:
            if s.get(field) is None or (run["kind"] == "main" and not _finite(s[field])):
                problems.append(f"{name} step {s['step']}: {field} is {s.get(field)!r}")
    for before, after in zip(run["steps"], run["steps"][1:], strict=False):
        pushed, used = before.get("policy_versions"), after.get("rollout_versions")
        if after["step"] == before["step"] + 1 and pushed and used and set(used) != {min(pushed)}:
            problems.append(
                f"{name} step {after['step']}: batch generated by policy {used}, but step "
                f"{before['step']} pushed {pushed} (off-policy)"
            )
    return problems


def check(data: dict[str, Any]) -> list[str]:
    """Every problem of a records file: each planned main run present, each run whole."""
    problems = []
    have = {run_key(r): r for r in data["runs"]}
    for key in expected_runs(data["plan"]):
        if key not in have:
            problems.append(f"missing run: {run_name(dict(zip(_KEY, key, strict=True)))}")
    for run in data["runs"]:
        problems += check_run(run)
    probe = data.get("probe") or {}
    for rate in probe.get("rates_tried", []):
        for mode in probe.get("modes_at", {}).get(str(rate), []):
            key = ("probe", probe["family"], mode, "bfloat16", probe["seed"], rate)
            if key not in have:
                problems.append(f"missing probe run: {mode} at lr {rate}")
    return problems


_KEY = ("kind", "family", "mode", "dtype", "seed", "lr")


def run_name(run: dict[str, Any]) -> str:
    label = LABELS.get((run["mode"], run["dtype"]), f"{run['mode']} {run['dtype']}")
    return f"{run['kind']} {run['family']} {label} seed {run['seed']} lr {run['lr']:g}"


def _ranges(values: Sequence[int]) -> str:
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(f"{start}" if start == v else f"{start}-{v}")
            start = None
    return ", ".join(out)


# -- summaries ------------------------------------------------------------------------------


def value(record: dict[str, Any], field: str) -> float:
    """A step's figure as one number: per-layer agreement averaged over the layers, the
    gradient norm averaged over the step's optimizer steps."""
    v = record.get(field)
    if v is None:
        return math.nan
    if isinstance(v, list):
        return float(np.mean(v)) if v else math.nan
    return float(v)


def last(run: dict[str, Any], window: int = WINDOW) -> list[dict[str, Any]]:
    return run["steps"][-window:]


@dataclass(frozen=True)
class Cell:
    """Medians over the last steps of every seed's run of one family and variant (pooled),
    and each seed's own median of the KL."""

    family: str
    mode: str
    dtype: str
    seeds: int
    steps: int  # records pooled
    medians: dict[str, float]
    kl_per_seed: list[float]


SUMMARY_FIELDS = (
    "kl",
    "max_gap",
    "other_kl",
    "agreement",
    "clip_fraction",
    "grad_norm",
    "reward",
    "expected_reward",
)


def cells(data: dict[str, Any], kind: str = "main", lr: float | None = None) -> list[Cell]:
    """One ``Cell`` per family and variant with runs of ``kind`` (and learning rate ``lr``)."""
    out = []
    families = data["plan"]["families"]
    for family in families:
        for mode, dtype in VARIANTS:
            runs = [
                r
                for r in data["runs"]
                if r["kind"] == kind
                and r["family"] == family
                and (r["mode"], r["dtype"]) == (mode, dtype)
                and (lr is None or r["lr"] == lr)
                and r["steps"]
            ]
            if not runs:
                continue
            pooled = [s for r in runs for s in last(r)]
            medians = {f: _nanmedian([value(s, f) for s in pooled]) for f in SUMMARY_FIELDS}
            per_seed = [_nanmedian([value(s, "kl") for s in last(r)]) for r in runs]
            out.append(Cell(family, mode, dtype, len(runs), len(pooled), medians, per_seed))
    return out


def _nanmedian(values: Iterable[float]) -> float:
    arr = np.asarray(list(values), np.float64)
    arr = arr[~np.isnan(arr)]
    return float(np.median(arr)) if arr.size else math.nan


def ratios(table: list[Cell]) -> dict[str, dict[str, float]]:
    """Per family: R3's and R2's median KL over the disabled mode's, and the mismatch's
    sources (disabled bf16: routing + precision; R3 bf16: precision; R3 fp32: the residue)."""
    out = {}
    for family in dict.fromkeys(c.family for c in table):
        kl = {(c.mode, c.dtype): c.medians["kl"] for c in table if c.family == family}
        base = kl.get(("disabled", "bfloat16"), math.nan)
        r3 = kl.get(("R3", "bfloat16"), math.nan)
        fp32 = kl.get(("R3", "float32"), math.nan)
        out[family] = {
            "R3/disabled": r3 / base,
            "R2/disabled": kl.get(("R2", "bfloat16"), math.nan) / base,
            "routing": base - r3,
            "precision": r3 - fp32,
            "residue": fp32,
            "R3 fp32/disabled": fp32 / base,
        }
    return out


def runaway(run: dict[str, Any]) -> dict[str, Any]:
    """Whether a probe run's KL or gradient norm ran away (see ``RUNAWAY_FACTOR``), with the
    growth factors it is judged by."""
    steps = run["steps"]
    n = min(RUNAWAY_STEPS, len(steps) // 2)
    verdict: dict[str, Any] = {"steps": len(steps), "finished": len(steps) == run["steps_planned"]}
    if n == 0:
        verdict.update(ran_away=not verdict["finished"])
        return verdict
    for field in ("agreement", "expected_reward", "entropy"):
        values = [value(s, field) for s in steps]
        verdict[f"{field}_first"] = _nanmedian(values[:n])
        verdict[f"{field}_last"] = _nanmedian(values[-n:])
    grew = {}
    for field in ("kl", "grad_norm"):
        values = [value(s, field) for s in steps]
        first, final = _nanmedian(values[:n]), _nanmedian(values[-n:])
        grew[field] = final / first if first > 0 else math.inf
        verdict[f"{field}_first"], verdict[f"{field}_last"] = first, final
        verdict[f"{field}_max"] = max(values)
    finite = all(_finite(value(s, f)) for s in steps for f in ("kl", "grad_norm"))
    verdict.update(
        growth=grew,
        finite=finite,
        ran_away=not finite
        or not verdict["finished"]
        or any(g >= RUNAWAY_FACTOR for g in grew.values()),
    )
    return verdict


def moved(data: dict[str, Any], family: str) -> dict[str, float]:
    """How far the main runs of ``family`` in ``disabled`` (bf16) moved: expected reward and
    natural agreement at step 0 and over the last steps (medians over the seeds)."""
    runs = [
        r
        for r in data["runs"]
        if r["kind"] == "main"
        and r["family"] == family
        and (r["mode"], r["dtype"]) == ("disabled", "bfloat16")
        and r["steps"]
    ]
    if not runs:
        return {}
    return {
        "reward_first": _nanmedian([value(r["steps"][0], "expected_reward") for r in runs]),
        "reward_last": _nanmedian([value(r["steps"][-1], "expected_reward") for r in runs]),
        "agreement_first": _nanmedian([value(r["steps"][0], "agreement") for r in runs]),
        "agreement_last": _nanmedian([value(s, "agreement") for r in runs for s in last(r)]),
    }


def probe_verdicts(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The collapse probe's verdicts, recomputed from its runs' records (in the order run)."""
    probe = data.get("probe") or {}
    runs = {run_key(r): r for r in data["runs"]}
    out = []
    for v in probe.get("verdicts", []):
        key = ("probe", probe["family"], v["mode"], "bfloat16", probe["seed"], v["lr"])
        run = runs.get(key)
        out.append({"lr": v["lr"], "mode": v["mode"], **runaway(run)} if run else v)
    return out


# -- the docs' section ----------------------------------------------------------------------


def fmt(x: float) -> str:
    if x is None or not math.isfinite(x):
        return "-"
    if x == 0:
        return "0"
    return f"{x:.2e}" if abs(x) < 1e-2 or abs(x) >= 1e3 else f"{x:.3f}"


def verdict(ratio: float) -> str:
    """R3's ratio against the target."""
    if not math.isfinite(ratio):
        return "not measured"
    return "met" if ratio <= TARGET_R3_RATIO else "missed"


def _x(x: float) -> str:
    if not math.isfinite(x):
        return "-"
    return f"{x:.3f}" if x >= 1e-3 else f"{x:.1e}"


def _count(n: int, what: str) -> str:
    return f"{n} {what}{'s' if n != 1 else ''}"


def _pct(x: float | None) -> str:
    return "-" if x is None or not math.isfinite(x) else f"{x:.1%}"


def table_markdown(table: list[Cell]) -> str:
    head = (
        "| family | mode | seeds x steps | KL (k3) | per seed | largest gap | "
        "KL, other routing | agreement | clip fraction | grad norm | reward | expected reward |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for c in table:
        m = c.medians
        rows.append(
            f"| {c.family} | {LABELS[(c.mode, c.dtype)]} | {c.seeds} x {c.steps // c.seeds} | "
            f"**{fmt(m['kl'])}** | {' / '.join(fmt(k) for k in c.kl_per_seed)} | "
            f"{fmt(m['max_gap'])} | {fmt(m['other_kl'])} | {m['agreement']:.2%} | "
            f"{fmt(m['clip_fraction'])} | {fmt(m['grad_norm'])} | {fmt(m['reward'])} | "
            f"{fmt(m['expected_reward'])} |"
        )
    return head + "\n".join(rows) + "\n"


def ratios_markdown(table: list[Cell]) -> str:
    paper = PAPER_DENSE_KL / PAPER_MOE_KL
    head = (
        "| family | R3 / disabled (target <= 0.5) | R2 / disabled | R3 fp32 trainer / disabled | "
        "paper: dense / MoE KL | routing's part | precision's part | kernels' residue |\n"
        "|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for family, r in ratios(table).items():
        rows.append(
            f"| {family} | **{_x(r['R3/disabled'])}** ({verdict(r['R3/disabled'])}) | "
            f"{_x(r['R2/disabled'])} | {_x(r['R3 fp32/disabled'])} | {paper:.3f} "
            f"({PAPER_DENSE_KL:.2g} / {PAPER_MOE_KL:.4g}) | {fmt(r['routing'])} | "
            f"{fmt(r['precision'])} | {fmt(r['residue'])} |"
        )
    return head + "\n".join(rows) + "\n"


def probe_markdown(probe: dict[str, Any]) -> str:
    if not probe or not probe.get("verdicts"):
        return "No collapse probe in this run.\n"
    head = (
        f"| lr | mode | steps | KL first -> last (medians of {RUNAWAY_STEPS} steps) | "
        "grad norm first -> last | largest grad norm | agreement first -> last | "
        "expected reward first -> last | entropy first -> last | ran away |\n"
        "|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for v in probe["verdicts"]:
        rows.append(
            f"| {v['lr']:g} | {v['mode']} | {v['steps']} | {fmt(v.get('kl_first'))} -> "
            f"{fmt(v.get('kl_last'))} | {fmt(v.get('grad_norm_first'))} -> "
            f"{fmt(v.get('grad_norm_last'))} | {fmt(v.get('grad_norm_max'))} | "
            f"{_pct(v.get('agreement_first'))} -> {_pct(v.get('agreement_last'))} | "
            f"{fmt(v.get('expected_reward_first'))} -> {fmt(v.get('expected_reward_last'))} | "
            f"{fmt(v.get('entropy_first'))} -> {fmt(v.get('entropy_last'))} | "
            f"{'**yes**' if v['ran_away'] else 'no'} |"
        )
    return head + "\n".join(rows) + "\n"


# -- the figure -----------------------------------------------------------------------------


def figure(data: dict[str, Any], out, kind: str = "main", title: str = "") -> None:
    """KL, routing agreement and expected reward over steps: per family a column, per
    variant a line (the seeds' median per step) with the seeds' range shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in data["runs"] if r["kind"] == kind and r["steps"]]
    families = [f for f in data["plan"]["families"] if any(r["family"] == f for r in runs)]
    if kind == "probe":
        families = [data["probe"]["family"]]
    lrs = sorted({r["lr"] for r in runs})
    rows = (
        ("kl", "KL(rollout || trainer), k3", True),
        ("agreement", "natural top-k = rollout's, mean over layers", False),
        ("expected_reward", "expected reward", False),
    )
    if kind == "probe":
        rows = (rows[0], rows[1], ("grad_norm", "gradient norm", True), rows[2])
    columns = [(f, lr) for f in families for lr in lrs]
    heights = [1.6] + [1.0] * (len(rows) - 1)  # the KL row spans many decades
    fig, axes = plt.subplots(
        len(rows),
        len(columns),
        figsize=(5.5 * len(columns), 2.8 * sum(heights)),
        squeeze=False,
        gridspec_kw={"height_ratios": heights},
    )
    for col, (family, lr) in enumerate(columns):
        for row, (field, label, log) in enumerate(rows):
            ax = axes[row][col]
            for i, (mode, dtype) in enumerate(VARIANTS):
                mine = [
                    r
                    for r in runs
                    if r["family"] == family
                    and r["lr"] == lr
                    and (r["mode"], r["dtype"]) == (mode, dtype)
                ]
                if not mine:
                    continue
                length = max(len(r["steps"]) for r in mine)
                grid = np.full((len(mine), length), np.nan)
                for j, r in enumerate(mine):
                    for s in r["steps"]:
                        grid[j, s["step"]] = value(s, field)
                x = np.arange(length)
                with np.errstate(all="ignore"):
                    mid = np.nanmedian(grid, axis=0)
                    lo, hi = np.nanmin(grid, axis=0), np.nanmax(grid, axis=0)
                color = f"C{i}"
                ax.plot(
                    x,
                    mid,
                    color=color,
                    lw=1.2,
                    label=f"{LABELS[(mode, dtype)]} ({_count(len(mine), 'seed')})",
                )
                if len(mine) > 1:
                    ax.fill_between(x, lo, hi, color=color, alpha=0.2, lw=0)
            if log:
                ax.set_yscale("log")
            ax.set_title(f"{family}, lr {lr:g}: {label}", fontsize=9)
            ax.set_xlabel("RL step", fontsize=8)
            ax.tick_params(labelsize=8)
        axes[0][col].legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
