"""What the RL step's stages hand each other: which routing each pass uses (``PASSES``) and the
small frozen result of each stage, in the order ``RLStep.run`` makes them.

``Laid`` (the step's layout) -> ``OldPass`` (the old-logprob pass) -> ``Comparison`` (the
comparison pass and the routing agreement) -> ``Updates`` (the update epochs); the report is
built from those (``trainer.rl.measure.step_report``), and ``StepResult`` is what the step
returns: the report and the routes its update passes used.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np
import torch

from routereplay.domain.record import Record
from trainer.config import ReplayMode
from trainer.layout import MicroBatch, StepLayout
from trainer.layout.batch import PaddedBatch
from trainer.report.step_report import StepReport


class Routing(enum.Enum):
    """What a pass's routers use."""

    NATURAL = "natural"
    ROLLOUT = "rollout"  # the rollout's routes, replayed
    RECORDED = "recorded"  # what the old-logprob pass chose, replayed


@dataclass(frozen=True)
class Passes:
    old: Routing
    update: Routing
    compare: Routing


PASSES = {
    ReplayMode.DISABLED: Passes(Routing.NATURAL, Routing.NATURAL, Routing.ROLLOUT),
    ReplayMode.R2: Passes(Routing.NATURAL, Routing.RECORDED, Routing.ROLLOUT),
    ReplayMode.R3: Passes(Routing.ROLLOUT, Routing.ROLLOUT, Routing.NATURAL),
}

# Per layer of a pass: what its router did on this rank's rows, ``{"natural": ids, "used":
# ids}`` (``trainer.model.replay.Replay.observe``).
Observed = dict[int, dict[str, torch.Tensor]]
# Per layer: int64 ``[rows, topk]`` ids of this rank's rows (``MASKED``: none).
ByLayer = dict[int, torch.Tensor]


@dataclass(frozen=True)
class Laid:
    """The layout stage: rewards of the whole batch (single-rank order) and this rank's layout
    (in R3 with each micro-batch's replay reference, ``StepLayout.reference``)."""

    rewards: list[float]
    layout: StepLayout
    micro_batches: list[MicroBatch]

    @property
    def batches(self) -> list[PaddedBatch]:
        return [mb.batch for mb in self.micro_batches]


@dataclass(frozen=True)
class OldPass:
    """The old-logprob pass (no gradients), per micro-batch: the log-probs, what each router
    did (``routes``) and chose on the rows that have a route (``chosen``, ``MASKED``
    elsewhere: R2's replay ids); over this rank's generated tokens, the sampled token's
    probability (``mass``) and the entropy; and, when it replayed, ``replay_followed``'s
    counts (``trainer.rl.counts.count_same``)."""

    logp: list[torch.Tensor]
    routes: list[Observed]
    chosen: list[ByLayer]
    mass: torch.Tensor
    entropy: torch.Tensor
    followed: np.ndarray


@dataclass(frozen=True)
class Comparison:
    """The comparison pass's log-probs (None without one) and the natural pass's routing
    agreement with the rollout, summed over every rank."""

    logp: list[torch.Tensor] | None
    agree: np.ndarray


@dataclass(frozen=True)
class Updates:
    """The update epochs: this rank's loss and clip fraction per mini-batch step, the update
    agreement per epoch (every rank's), megatron's aux loss per MoE layer, the rows replayed
    and, when they replayed the rollout's routes, ``replay_followed``'s counts; the L2 norm of
    the gradient each optimizer step applied, where one rank's norm is the whole gradient's
    (no model parallelism; None otherwise)."""

    losses: list[float]
    clips: list[float]
    drift: list[float]
    aux_layers: list[float] | None
    replayed: int
    followed: np.ndarray
    grad_norm: list[float] | None


@dataclass(frozen=True)
class StepResult:
    """One step: its report and, with ``router_replay.record_file``, the routes its update
    passes used as layout-free records (R3: the rollout's; R2: recorded; disabled: the
    old-logprob pass's natural ones); empty otherwise."""

    report: StepReport
    routes_used: list[Record]
