"""The stability run's per-step records: made from the trainer's step reports, checked, and
summarised into the table and figure of docs/benchmarks.md (``bench_stability.py``).

Torch-free and service-free, so the checks and the summaries run anywhere on the JSON alone
(``python -m benchmarks.stability.bench_stability --from-records FILE``).

**The records file** (JSON): ``plan`` (what was asked: families, seeds, steps per run, the
learning rate, the collapse probe's rates), ``runs`` (one per family, variant, seed and
learning rate and router margin: its settings, ``router_spread`` and ``staleness`` (absent in
records older than them: 0.03 and 0), ``steps_planned`` and ``steps``, one record per RL step)
and ``probe`` (the collapse probe's verdicts). The collapse criterion (``collapse``) reads
``ratio_gt_2``, ``grad_norm`` and ``expected_reward``, which every record holds; the paired
ratio (``paired_ratio``) reads ``kl`` and ``other_kl``. A step's record (``step_record``):

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
  comes from the previous step's push (with ``staleness`` k: at most k versions older), which
  ``check`` verifies.
"""

from __future__ import annotations

import math
import textwrap
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
# The main run's router margins (``routereplay.dev.tiny_model.REALISTIC_ROUTER_SPREAD``, kept
# here as a number so this module needs no torch): the spread of records that name none.
DEFAULT_SPREAD = 0.03
# The last steps the table's medians are taken over (fewer when a run is shorter).
WINDOW = 20
# The R3 paper's training-inference KL (Qwen3-30B-A3B, MoE) and a dense model's (Qwen3-8B):
# the level the paper's MoE would reach with routing mismatch gone.
PAPER_MOE_KL = 1.535e-3
PAPER_DENSE_KL = 6.4e-4
TARGET_R3_RATIO = 0.5
# A run collapses (``collapse``) when training itself fails, not when the KL merely grows (a
# sharpening policy grows it in every mode): a value not finite or the trainer dead; a step
# with at least EXTREME_FRACTION of its tokens at a probability ratio above 2 or below 1/2
# (the R3 paper's "extreme tokens"); a step's gradient norm BLOWUP_FACTOR times the median of
# the steps before it (the first COLLAPSE_WINDOW steps, whose early spikes every mode and dtype
# shows, excluded); or the expected reward of the last COLLAPSE_WINDOW steps at most
# REWARD_FALL of the best COLLAPSE_WINDOW-step window before (the expected reward, not the
# batch's: 8 samples of a 1-in-8 reward are too noisy to read a fall from).
COLLAPSE_WINDOW = 5
EXTREME_FRACTION = 0.01
BLOWUP_FACTOR = 10.0
REWARD_FALL = 0.5
# Reported beside it, not a verdict: KL growth, last COLLAPSE_WINDOW steps over the first.

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
    spread = run.get("router_spread", DEFAULT_SPREAD)
    return (run["kind"], run["family"], run["mode"], run["dtype"], run["seed"], run["lr"], spread)


def _spread(run: dict[str, Any]) -> float:
    return run.get("router_spread", DEFAULT_SPREAD)


def spreads(plan: dict[str, Any]) -> list[float]:
    return list(plan.get("router_spreads", [DEFAULT_SPREAD]))


def at_spread(data: dict[str, Any], spread: float) -> dict[str, Any]:
    """``data`` with only the runs of router margins ``spread``."""
    runs = [r for r in data["runs"] if r.get("router_spread", DEFAULT_SPREAD) == spread]
    return {**data, "runs": runs}


def expected_runs(plan: dict[str, Any]) -> list[tuple]:
    """The main runs the plan asks for (``run_key``'s form): every variant per family and
    seed, R3 with a float32 trainer for the first ``fp32_seeds`` seeds only; the probe's runs
    depend on what it finds and are checked from its own verdicts."""
    fp32_seeds = plan.get("fp32_seeds", len(plan["seeds"]))
    return [
        ("main", family, mode, dtype, seed, plan["lr"], spread)
        for spread in spreads(plan)
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
    stale = run.get("staleness", 0)
    for before, after in zip(run["steps"], run["steps"][1:], strict=False):
        pushed, used = before.get("policy_versions"), after.get("rollout_versions")
        if after["step"] != before["step"] + 1 or not pushed or not used:
            continue
        lag = [min(pushed) - v for v in used]
        if not all(0 <= x <= stale for x in lag):
            allowed = "off-policy" if not stale else f"more than {stale} versions behind"
            problems.append(
                f"{name} step {after['step']}: batch generated by policy {used}, but step "
                f"{before['step']} pushed {pushed} ({allowed})"
            )
    return problems


def lags(run: dict[str, Any]) -> list[int]:
    """Per step after the first, how many policy versions its batch lagged the newest."""
    out = []
    for before, after in zip(run["steps"], run["steps"][1:], strict=False):
        pushed, used = before.get("policy_versions"), after.get("rollout_versions")
        if pushed and used:
            out.append(max(min(pushed) - v for v in used))
    return out


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
            if key + (spreads(data["plan"])[0],) not in have:
                problems.append(f"missing probe run: {mode} at lr {rate}")
    return problems


_KEY = ("kind", "family", "mode", "dtype", "seed", "lr", "router_spread")


def run_name(run: dict[str, Any]) -> str:
    label = LABELS.get((run["mode"], run["dtype"]), f"{run['mode']} {run['dtype']}")
    spread = run.get("router_spread", DEFAULT_SPREAD)
    margins = "" if spread == DEFAULT_SPREAD else f" router spread {spread:g}"
    return f"{run['kind']} {run['family']} {label} seed {run['seed']} lr {run['lr']:g}{margins}"


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


def _jump(grad: float, before: float) -> float:
    """``grad`` over the median ``before`` it; nan (no jump measured) from a zero median: a
    policy gone deterministic has no gradient left, and its numerical residue after that is
    not a blow-up."""
    return grad / before if before > 0 else math.nan


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


def collapse(run: dict[str, Any]) -> dict[str, Any]:
    """Whether a run collapsed (see ``COLLAPSE_WINDOW``), which criterion fired, and the run's
    first and last ``COLLAPSE_WINDOW`` steps' medians of KL, gradient norm, agreement, expected
    reward and entropy beside it."""
    steps = run["steps"]
    w = COLLAPSE_WINDOW
    n = min(w, len(steps) // 2)
    verdict: dict[str, Any] = {"steps": len(steps), "finished": len(steps) == run["steps_planned"]}
    fired = [] if verdict["finished"] else ["trainer died"]
    if n == 0:
        verdict.update(collapsed=bool(fired), fired=fired)
        return verdict
    for field in ("kl", "grad_norm", "agreement", "expected_reward", "entropy"):
        values = [value(s, field) for s in steps]
        verdict[f"{field}_first"] = _nanmedian(values[:n])
        verdict[f"{field}_last"] = _nanmedian(values[-n:])
    kl0 = verdict["kl_first"]
    verdict["kl_growth"] = verdict["kl_last"] / kl0 if kl0 > 0 else math.inf
    if not all(_finite(value(s, f)) for s in steps for f in ("kl", "grad_norm")):
        fired.append("not finite")
    extreme = [value(s, "ratio_gt_2") for s in steps]
    verdict["extreme_max"] = float(np.nanmax(extreme)) if extreme else math.nan
    if verdict["extreme_max"] >= EXTREME_FRACTION:
        fired.append("extreme tokens")
    grads = [value(s, "grad_norm") for s in steps]
    verdict["grad_norm_max"] = float(np.nanmax(grads))
    jumps = [_jump(grads[i], _nanmedian(grads[w:i])) for i in range(2 * w, len(grads))]
    verdict["grad_jump"] = float(np.nanmax(jumps)) if jumps else math.nan
    if jumps and verdict["grad_jump"] >= BLOWUP_FACTOR:
        fired.append("gradient blow-up")
    reward = [value(s, "expected_reward") for s in steps]
    windows = [float(np.mean(reward[i : i + w])) for i in range(0, len(reward) - w + 1)]
    if len(windows) > w:
        best = max(windows[:-w])
        verdict["reward_kept"] = windows[-1] / best if best > 0 else math.nan
        if verdict["reward_kept"] <= REWARD_FALL:
            fired.append("reward fell")
    verdict.update(collapsed=bool(fired), fired=fired)
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


def paired_ratio(record: dict[str, Any], mode: str) -> float:
    """One step's KL with the rollout's routes replayed over its KL with natural routing: the
    same weights and the same batch, only the routing differs (the step's own pass and its
    comparison pass)."""
    mine, other = value(record, "kl"), value(record, "other_kl")
    replayed, natural = (mine, other) if trained_routing(mode) == "replayed" else (other, mine)
    return replayed / natural if natural > 0 else math.nan


def _runs(data, family, mode, dtype="bfloat16", kind="main"):
    return [
        r
        for r in data["runs"]
        if r["kind"] == kind
        and r["family"] == family
        and (r["mode"], r["dtype"]) == (mode, dtype)
        and r["steps"]
    ]


def thirds(data: dict[str, Any], kind: str = "main") -> dict[str, dict[str, Any]]:
    """Per family, by thirds of the run (seeds pooled): each mode's paired ratio (median of
    ``paired_ratio`` over the third's steps), R3's median KL over ``disabled``'s, and the
    fraction of the first third's steps whose paired ratio (in ``disabled``) is above 0.5."""
    out = {}
    for family in data["plan"]["families"]:
        row: dict[str, Any] = {}
        for mode in PROBE_MODES:
            runs = _runs(data, family, mode, kind=kind)
            if not runs:
                continue
            row[mode] = [
                _nanmedian(paired_ratio(s, mode) for r in runs for s in _third(r, i))
                for i in range(3)
            ]
        base, r3 = _runs(data, family, "disabled", kind=kind), _runs(data, family, "R3", kind=kind)
        if base and r3:
            row["R3/disabled"] = [
                _nanmedian(value(s, "kl") for r in r3 for s in _third(r, i))
                / _nanmedian(value(s, "kl") for r in base for s in _third(r, i))
                for i in range(3)
            ]
            first = [paired_ratio(s, "disabled") for r in base for s in _third(r, 0)]
            row["above_half_first"] = float(np.mean([x > 0.5 for x in first]))
        if row:
            out[family] = row
    return out


def _third(run: dict[str, Any], i: int) -> list[dict[str, Any]]:
    n = len(run["steps"])
    return run["steps"][i * n // 3 : (i + 1) * n // 3]


def paired_last(data: dict[str, Any], family: str, mode: str) -> float:
    """The paired ratio over the last ``WINDOW`` steps of every seed (median, pooled)."""
    runs = _runs(data, family, mode)
    return _nanmedian(paired_ratio(s, mode) for r in runs for s in last(r))


def scale(data: dict[str, Any], kind: str = "main") -> dict[str, Any]:
    """The absolute scale of every ``kind`` run's steps, and what was not seen: the median KL
    of the bf16 trainer's steps, the largest per-token gap and its probability ratio, the
    largest fraction of tokens at a ratio above 2 (or below 1/2), the entropy's range, the
    steps with a nonzero clip fraction, and each mode's median batch reward."""
    runs = [r for r in data["runs"] if r["kind"] == kind and r["steps"]]
    steps = [s for r in runs for s in r["steps"]]
    if not steps:
        return {}
    bf16 = [s for r in runs if r["dtype"] == "bfloat16" for s in r["steps"]]
    gap = max(value(s, "max_gap") for s in steps)
    clipped = sorted({s["step"] for s in steps if value(s, "clip_fraction") > 0})
    rewards = {}
    for r in runs:
        rewards.setdefault(LABELS.get((r["mode"], r["dtype"]), r["mode"]), []).extend(
            value(s, "reward") for s in r["steps"]
        )
    entropy = [value(s, "entropy") for s in steps]
    return {
        "records": len(steps),
        "median_kl": _nanmedian(value(s, "kl") for s in bf16),
        "largest_gap": gap,
        "largest_ratio": math.exp(gap),
        "extreme_max": max(value(s, "ratio_gt_2") for s in steps),
        "entropy_first": _nanmedian(value(r["steps"][0], "entropy") for r in runs),
        "entropy_last": _nanmedian(value(r["steps"][-1], "entropy") for r in runs),
        "entropy_min": float(np.nanmin(entropy)),
        "entropy_max": float(np.nanmax(entropy)),
        "last_clipped_step": clipped[-1] if clipped else None,
        "largest_clip_fraction": max(value(s, "clip_fraction") for s in steps),
        "fp32_clipped": any(
            value(s, "clip_fraction") > 0
            for r in runs
            if r["dtype"] == "float32"
            for s in r["steps"]
        ),
        "collapsed": [run_name(r) for r in runs if collapse(r)["collapsed"]],
        "runs": len(runs),
        "reward": {label: _nanmedian(v) for label, v in rewards.items()},
    }


def epoch_agreement(data: dict[str, Any]) -> dict[tuple[str, str], list[float]]:
    """Per family and mode (bf16 main runs, every step of every seed): per PPO epoch, the
    median fraction of routing choices where the routers' natural top-k in the update pass
    equals the old-logprob pass's routes (``update_agreement``). ``disabled`` trains on those
    natural choices, so this is how far its routing moved within the step; R2 and R3 replay the
    old pass's routes, so theirs is what they would have drifted to without replay."""
    out = {}
    for family in data["plan"]["families"]:
        for mode in PROBE_MODES:
            runs = _runs(data, family, mode)
            rows = [s["update_agreement"] for r in runs for s in r["steps"]]
            if rows and all(rows):
                epochs = min(len(x) for x in rows)
                out[(family, mode)] = [_nanmedian(x[e] for x in rows) for e in range(epochs)]
    return out


def probe_verdicts(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The collapse probe's verdicts, recomputed from its runs' records (in the order run)."""
    probe = data.get("probe") or {}
    runs = {run_key(r): r for r in data["runs"]}
    out = []
    for v in probe.get("verdicts", []):
        key = ("probe", probe["family"], v["mode"], "bfloat16", probe["seed"], v["lr"])
        run = runs.get(key + (spreads(data["plan"])[0],))
        out.append({"lr": v["lr"], "mode": v["mode"], **collapse(run)} if run else v)
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


def ratios_markdown(data: dict[str, Any], table: list[Cell]) -> str:
    head = (
        "| family | paired: replayed / natural KL, same weights and batch (disabled / R2 / R3) | "
        "R3 / disabled, separate runs (target <= 0.5) | R2 / disabled | routing's part | "
        "precision's part | kernels' residue |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for family, r in ratios(table).items():
        paired = " / ".join(_x(paired_last(data, family, m)) for m in PROBE_MODES)
        rows.append(
            f"| {family} | **{paired}** | {_x(r['R3/disabled'])} ({verdict(r['R3/disabled'])}) | "
            f"{_x(r['R2/disabled'])} | {fmt(r['routing'])} | {fmt(r['precision'])} | "
            f"{fmt(r['residue'])} |"
        )
    return head + "\n".join(rows) + "\n"


def thirds_markdown(data: dict[str, Any]) -> str:
    head = (
        "| family | steps | paired, disabled | paired, R2 | paired, R3 | "
        "R3 / disabled, separate runs |\n|---|---|---|---|---|---|\n"
    )
    rows = []
    for family, row in thirds(data).items():
        n = data["plan"]["steps"]
        for i in range(3):
            cols = [_x(row[m][i]) if m in row else "-" for m in PROBE_MODES]
            ratio = _x(row["R3/disabled"][i]) if "R3/disabled" in row else "-"
            rows.append(
                f"| {family} | {i * n // 3}-{(i + 1) * n // 3 - 1} | {' | '.join(cols)} | {ratio} |"
            )
    return head + "\n".join(rows) + "\n"


def agreement_markdown(data: dict[str, Any]) -> str:
    found = epoch_agreement(data)
    if not found:
        return ""
    epochs = max(len(v) for v in found.values())
    head = (
        "| family | mode | "
        + " | ".join(f"natural = old pass's, epoch {e + 1}" for e in range(epochs))
        + " | routes trained = old pass's |\n"
        + "|---|---|"
        + "---|" * (epochs + 1)
        + "\n"
    )
    rows = []
    for (family, mode), per_epoch in found.items():
        trained = "100% (replayed)"
        if mode == "disabled":
            trained = " / ".join(_pct(x) for x in per_epoch)
        cols = " | ".join(_pct(x) for x in per_epoch)
        rows.append(f"| {family} | {mode} | {cols} | {trained} |")
    return head + "\n".join(rows) + "\n"


def sweep_markdown(data: dict[str, Any]) -> str:
    """Per router margin (wide to narrow as given) and family: the natural agreement, the
    median KL of ``disabled`` and the ratios, over the last ``WINDOW`` steps."""
    head = (
        "| router spread | family | natural agreement (disabled) | KL, disabled | "
        "paired: replayed / natural (disabled / R2 / R3) | R3 / disabled, separate runs |\n"
        "|---|---|---|---|---|---|\n"
    )
    rows = []
    for spread in spreads(data["plan"]):
        part = at_spread(data, spread)
        table = {(c.family, c.mode, c.dtype): c for c in cells(part)}
        for family, r in ratios(list(table.values())).items():
            base = table.get((family, "disabled", "bfloat16"))
            paired = " / ".join(_x(paired_last(part, family, m)) for m in PROBE_MODES)
            rows.append(
                f"| {spread:g} | {family} | {_pct(base.medians['agreement']) if base else '-'} | "
                f"{fmt(base.medians['kl']) if base else '-'} | {paired} | {_x(r['R3/disabled'])} |"
            )
    return head + "\n".join(rows) + "\n"


def probe_markdown(probe: dict[str, Any]) -> str:
    if not probe or not probe.get("verdicts"):
        return "No collapse probe in this run.\n"
    w = COLLAPSE_WINDOW
    head = (
        f"| lr | mode | steps | KL first -> last (medians of {w} steps) | KL growth | "
        "grad norm first -> last | largest gradient jump | most tokens at ratio > 2 | "
        "agreement first -> last | expected reward first -> last | reward kept | "
        "entropy first -> last | collapsed |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    rows = []
    for v in probe["verdicts"]:
        fired = ", ".join(v.get("fired", []))
        rows.append(
            f"| {v['lr']:g} | {v['mode']} | {v['steps']} | {fmt(v.get('kl_first'))} -> "
            f"{fmt(v.get('kl_last'))} | {_x(v.get('kl_growth', math.nan))}x | "
            f"{fmt(v.get('grad_norm_first'))} -> {fmt(v.get('grad_norm_last'))} | "
            f"{_x(v.get('grad_jump', math.nan))}x | {_pct(v.get('extreme_max'))} | "
            f"{_pct(v.get('agreement_first'))} -> {_pct(v.get('agreement_last'))} | "
            f"{fmt(v.get('expected_reward_first'))} -> {fmt(v.get('expected_reward_last'))} | "
            f"{_pct(v.get('reward_kept'))} | "
            f"{fmt(v.get('entropy_first'))} -> {fmt(v.get('entropy_last'))} | "
            f"{f'**yes** ({fired})' if v.get('collapsed') else 'no'} |"
        )
    return head + "\n".join(rows) + "\n"


# -- the figure -----------------------------------------------------------------------------


def figure(data: dict[str, Any], out, kind: str = "main", title: str = "") -> None:
    """Per family and learning rate a column, per measure a row, per variant a line (the
    seeds' median per step) with the seeds' range shaded. The float32-trainer line (about
    1e-14) is left out of the KL row, which would otherwise span nine decades and squeeze the
    gap between the bf16 modes; the main runs' last ``WINDOW`` steps (the table's) are shaded."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r for r in data["runs"] if r["kind"] == kind and r["steps"]]
    families = [f for f in data["plan"]["families"] if any(r["family"] == f for r in runs)]
    if kind == "probe":
        families = [data["probe"]["family"]]
    lrs = sorted({r["lr"] for r in runs})
    margins = [s for s in spreads(data["plan"]) if any(_spread(r) == s for r in runs)]
    # (field, y-axis label, log scale, the variants drawn)
    bf16 = [v for v in VARIANTS if v[1] == "bfloat16"]
    rows = [
        ("kl", "KL(rollout || trainer), k3", True, bf16),
        ("paired", "replayed / natural KL,\nsame weights and batch", False, bf16),
        ("agreement", "natural top-k = rollout's\n(mean over layers)", False, list(VARIANTS)),
        ("expected_reward", "expected reward", False, list(VARIANTS)),
    ]
    if kind == "probe":
        rows.insert(3, ("grad_norm", "gradient norm", True, bf16))
    columns = [(f, lr, s) for f in families for lr in lrs for s in margins]
    fig, axes = plt.subplots(
        len(rows), len(columns), figsize=(5.5 * len(columns), 2.6 * len(rows)), squeeze=False
    )
    for col, (family, lr, spread) in enumerate(columns):
        for row, (field, label, log, variants) in enumerate(rows):
            ax = axes[row][col]
            for mode, dtype in variants:
                mine = [
                    r
                    for r in runs
                    if r["family"] == family
                    and r["lr"] == lr
                    and _spread(r) == spread
                    and (r["mode"], r["dtype"]) == (mode, dtype)
                ]
                if not mine:
                    continue
                length = max(len(r["steps"]) for r in mine)
                grid = np.full((len(mine), length), np.nan)
                for j, r in enumerate(mine):
                    for s in r["steps"]:
                        grid[j, s["step"]] = (
                            paired_ratio(s, mode) if field == "paired" else value(s, field)
                        )
                x = np.arange(length)
                with np.errstate(all="ignore"):
                    mid = np.nanmedian(grid, axis=0)
                    lo, hi = np.nanmin(grid, axis=0), np.nanmax(grid, axis=0)
                color = f"C{VARIANTS.index((mode, dtype))}"
                ax.plot(
                    x,
                    mid,
                    color=color,
                    lw=1.2,
                    label=f"{LABELS[(mode, dtype)]} ({_count(len(mine), 'seed')})",
                )
                if len(mine) > 1:
                    ax.fill_between(x, lo, hi, color=color, alpha=0.2, lw=0)
            if kind == "main":
                length = max(len(r["steps"]) for r in runs)
                ax.axvspan(max(0, length - WINDOW) - 0.5, length - 0.5, color="0.9", zorder=0, lw=0)
            if log:
                ax.set_yscale("log")
            ax.set_ylabel(label, fontsize=8)
            margin = f", router spread {spread:g}" if len(margins) > 1 else ""
            ax.set_title(f"{family}, lr {lr:g}{margin}", fontsize=9)
            ax.set_xlabel("RL step", fontsize=8)
            ax.tick_params(labelsize=8)
        axes[0][col].legend(fontsize=7)
        axes[2][col].legend(fontsize=7)
    window = min(WINDOW, max(len(r["steps"]) for r in runs))
    note = (
        f"grey: the last {window} steps (the table's medians); R3 with a float32 trainer "
        "(KL about 1e-14) not drawn in the KL rows"
        if kind == "main"
        else "R3 with a float32 trainer not run in the probe"
    )
    width = max(40, int(16 * fig.get_size_inches()[0]))
    fig.suptitle(textwrap.fill(f"{title + ': ' if title else ''}{note}", width), fontsize=9)
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.5 / fig.get_size_inches()[1]))
    fig.savefig(out, dpi=100)
    plt.close(fig)
