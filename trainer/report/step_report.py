"""One RL step's consistency report, typed (``StepReport``), and its JSON form.

``RLStep.run`` returns it; the console line, TensorBoard, Prometheus, the JSON report and the
main job's figure read it by field. ``as_dict`` gives the JSON form (``report.json``, one
object per step); ``from_dict`` reads it back. What each figure means: docs/trainer.md.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any


@dataclass
class Gap:
    """Trainer against rollout log-probs over ``tokens`` generated tokens, from pass ``pass_``
    (``old_logprob`` or ``compare``)."""

    mean_abs: float
    max_abs: float
    k3_kl: float
    ratio_gt_2: float
    tokens: int
    pass_: str = ""


@dataclass
class Agreement:
    """Per MoE layer (``layers``, global numbers), the fraction of rows whose natural top-k set
    equals the rollout's (``exact``) and the mean shared fraction (``overlap``), over ``rows``."""

    layers: list[int]
    exact: list[float]
    overlap: list[float]
    rows: int


@dataclass
class ReplayFollowed:
    """R3: per MoE layer, the fraction of replayed router rows whose experts, as megatron's
    routing map sent them, are the record's row of their token; ``rows`` counted per layer
    over every replayed pass."""

    layers: list[int]
    exact: list[float]
    rows: list[int]


@dataclass
class Rows:
    valid: int
    replayed: int
    replayed_fraction: float
    masked_fraction: float


@dataclass
class RouteBytes:
    """Route bytes the ranks read from the route cache against the batch's stored bytes."""

    read: int
    batch: int
    read_per_batch: float


@dataclass
class Times:
    """Seconds per stage (the slowest rank's)."""

    fetch: float = 0.0
    fetch_wait: float = 0.0
    align: float = 0.0
    old_logprob: float = 0.0
    compare: float = 0.0
    update: float = 0.0


@dataclass
class FeedBatch:
    """A feed batch: its GRPO groups and the policy versions that generated its turns."""

    groups: list[str]
    rollout_versions: list[int]


@dataclass
class StepReport:
    """One step. ``replay_followed`` only in R3; ``policy_versions`` once the step's export was
    pushed to the rollout servers; ``feed`` when the batch came from the ready feed;
    ``grad_norm`` (the L2 norm of the gradient each optimizer step of the step applied) where
    every rank holds the whole model (one rank, or data parallel only)."""

    step: int
    mode: str
    samples: int
    reward_mean: float
    expected_reward: float
    entropy: float
    loss: float
    clip_fraction: float
    update_agreement: list[float]
    rows: Rows
    missing_records: int
    dropped_samples: int
    route_bytes: RouteBytes
    time_s: Times
    gap: dict[str, Gap]  # "natural" and "replayed"
    agreement: Agreement
    replay_followed: ReplayFollowed | None = None
    aux_loss: float | None = None
    aux_loss_layers: list[float] | None = None
    policy_versions: list[int] | None = None
    feed: FeedBatch | None = None
    grad_norm: list[float] | None = None

    def as_dict(self) -> dict[str, Any]:
        """The JSON form: optional parts left out when absent (``aux_loss`` kept as null)."""
        out = asdict(self)
        for name in _OPTIONAL:
            if out[name] is None:
                del out[name]
        for gap in out["gap"].values():
            gap["pass"] = gap.pop("pass_")
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepReport:
        """Read ``as_dict``'s form back (a ``report.json`` entry). A field without a default
        that is absent raises ``KeyError``: two reports missing the same figure must not read
        back as equal ``None``s."""
        kwargs = {
            f.name: data.get(f.name) if f.default is None else data[f.name] for f in fields(cls)
        }
        kwargs.update(
            rows=Rows(**data["rows"]),
            route_bytes=RouteBytes(**data["route_bytes"]),
            time_s=Times(**data["time_s"]),
            gap={
                name: Gap(**{k: v for k, v in g.items() if k != "pass"}, pass_=g.get("pass", ""))
                for name, g in data["gap"].items()
            },
            agreement=Agreement(**data["agreement"]),
            replay_followed=_maybe(ReplayFollowed, data.get("replay_followed")),
            feed=_maybe(FeedBatch, data.get("feed")),
        )
        return cls(**kwargs)


_OPTIONAL = ("replay_followed", "policy_versions", "feed", "grad_norm")


def _maybe(kind, data):
    return None if data is None else kind(**data)


def reports_from_json(data: list[dict[str, Any]]) -> list[StepReport]:
    return [StepReport.from_dict(entry) for entry in data]
