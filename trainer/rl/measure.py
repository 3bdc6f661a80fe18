"""The step's report built from its stages, with its totals named.

- The routing counts per layer and what they become in the report are ``counts``; the
  reference of ``replay_followed`` comes with the step's layout (``trainer.layout.reference``).
- Log-prob gap over generated tokens, trainer against rollout, with d = logp_trainer -
  logp_rollout: mean |d|, max |d|, the k3 estimate of KL(rollout || trainer),
  mean(exp(d) - 1 - d) (the samples come from the rollout policy), and the fraction of tokens
  whose probability ratio exceeds 2 either way (|d| > ln 2).
- The step's sums over the data-parallel ranks (``StepTotals``), megatron's aux loss
  (``AuxLoss``), and the report (``step_report``), summed or maxed over every rank.
"""

from __future__ import annotations

import math
import time
from dataclasses import astuple, dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from routereplay.domain.record import Geometry
from trainer.config import ReplayMode
from trainer.data.source import FetchedBatch
from trainer.distributed.dp import DataParallel
from trainer.report.step_report import (
    Gap,
    RouteBytes,
    Rows,
    StepReport,
    Times,
)
from trainer.rl.counts import agreement, replay_followed, world_sum
from trainer.rl.stages import Comparison, Laid, OldPass, Passes, Routing, Updates


@dataclass
class StepTotals:
    """The step's sums over the data-parallel ranks, by name (``summed`` adds every rank's)."""

    valid_rows: float = 0
    replayed_rows: float = 0
    mass_sum: float = 0.0  # probability of the sampled token, over generated tokens
    mass_tokens: float = 0
    entropy_sum: float = 0.0
    samples: float = 0
    missing: float = 0
    dropped: float = 0
    stored_route_bytes: float = 0

    def summed(self, dp) -> StepTotals:
        """Every DP rank's totals added, field by field (one collective)."""
        return StepTotals(*dp.sum(list(astuple(self))).tolist())


class AuxLoss:
    """Megatron's load-balancing aux loss of the update passes, per MoE layer.

    Megatron's router adds ``aux_loss / coeff`` to its layer-wise tracker in every training
    forward (``save_to_aux_losses_tracker``); the loss itself is computed from the router's
    *natural* top-k (``compute_routing_scores_for_aux_loss``), never the replayed routes. The
    tracker is cleared before the update passes and read after them (mean per forward); under
    pipeline stages each stage holds its own layers' entries, summed over the stages.
    """

    NAME = "load_balancing_loss"

    def __init__(self, built):
        self.layers = list(built.geometry.moe_layers)
        routers = built.routers
        self.enabled = bool(routers) and routers[0].router.is_aux_loss_enabled()
        if self.enabled:
            from megatron.core.transformer.moe import moe_utils

            self.moe_utils = moe_utils
            moe_utils.clear_aux_losses_tracker()

    def read(self, forwards: int, mp=None) -> list[float] | None:
        if not self.enabled:
            return None
        entry = self.moe_utils.get_moe_layer_wise_logging_tracker().get(self.NAME)
        values = entry["values"].detach().cpu().clone().double() if entry is not None else None
        if mp is not None and mp.pp_group is not None and mp.pp_group.size() > 1:
            if values is None:
                values = torch.zeros(max(self.layers) + 1, dtype=torch.float64)
            dist.all_reduce(values, group=mp.pp_group)
        if values is None:
            return None
        self.moe_utils.clear_aux_losses_tracker()
        return [float(values[layer]) / max(forwards, 1) for layer in self.layers]


@dataclass
class Clock:
    """Seconds per stage of a step: ``lap(name)`` charges the time since the last lap."""

    times: dict[str, float] = field(default_factory=dict)
    _last: float = field(default_factory=time.perf_counter)

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.times[name] = self.times.get(name, 0.0) + now - self._last
        self._last = now


def logprob_gap(trainer: np.ndarray, rollout: np.ndarray, pass_: str = "") -> Gap:
    """Gap between two float arrays of the same generated tokens' log-probs."""
    d = np.asarray(trainer, np.float64) - np.asarray(rollout, np.float64)
    if d.size == 0:
        return Gap(0.0, 0.0, 0.0, 0.0, 0, pass_)
    return Gap(
        float(np.abs(d).mean()),
        float(np.abs(d).max()),
        float((np.expm1(d) - d).mean()),
        float((np.abs(d) > math.log(2)).mean()),
        int(d.size),
        pass_,
    )


def in_batch_order(dp: DataParallel, local_mini: int, per_sample: dict[int, object]) -> list:
    """Per-sample items of every DP rank (keyed by their local batch position), in the
    single-rank order: mini-batch, then DP rank, then position (``local_mini``: a
    mini-batch's samples on one rank)."""
    parts = dp.all_gather(per_sample)
    keyed = sorted(
        ((j // local_mini, r, j), item) for r, part in enumerate(parts) for j, item in part.items()
    )
    return [item for _, item in keyed]


def gaps(
    laid: Laid,
    old: OldPass,
    compared: Comparison,
    passes: Passes,
    dp: DataParallel,
    local_mini: int,
) -> dict[str, Gap]:
    """Gap to the rollout per routing (``natural``, ``replayed``), over every DP rank's
    generated tokens."""
    gap = {}
    for key, per_mb, routing in (
        ("old_logprob", old.logp, passes.old),
        ("compare", compared.logp, passes.compare),
    ):
        if per_mb is None:
            continue
        per_sample = {}
        for mb, lp in zip(laid.micro_batches, per_mb, strict=True):
            sel = mb.generated & ~torch.isnan(mb.rollout_logp)
            for j, s, r, ok in zip(
                mb.index,
                mb.per_sample(lp),
                mb.per_sample(mb.rollout_logp),
                mb.per_sample(sel),
                strict=True,
            ):
                per_sample[j] = (s[ok].numpy(), r[ok].numpy())
        pairs = in_batch_order(dp, local_mini, per_sample)
        trainer = np.concatenate([p[0] for p in pairs]) if pairs else np.zeros(0)
        rollout = np.concatenate([p[1] for p in pairs]) if pairs else np.zeros(0)
        name = "replayed" if routing is Routing.ROLLOUT else "natural"
        gap[name] = logprob_gap(trainer, rollout, pass_=key)
    return gap


def _totals(
    fetched: FetchedBatch, laid: Laid, old: OldPass, updates: Updates, dp: DataParallel
) -> StepTotals:
    """The step's sums over every DP rank."""
    return StepTotals(
        valid_rows=sum(int(b.valid.sum()) for b in laid.batches),
        replayed_rows=updates.replayed,
        mass_sum=float(old.mass.double().sum()),
        mass_tokens=old.mass.numel(),
        entropy_sum=float(old.entropy.double().sum()),
        samples=len(fetched.samples),
        missing=len(fetched.missing),
        dropped=len(fetched.dropped),
        stored_route_bytes=sum(
            r.num_rows * r.geometry.row_bytes for r in fetched.records if r is not None
        ),
    ).summed(dp)


def _rows(totals: StepTotals, replay_update: bool) -> Rows:
    valid, replayed = int(totals.valid_rows), int(totals.replayed_rows)
    return Rows(
        valid=valid,
        replayed=replayed,
        replayed_fraction=replayed / max(valid, 1),
        masked_fraction=1 - replayed / max(valid, 1) if replay_update else 0.0,
    )


def _times(fetched: FetchedBatch, clock: Clock, dp: DataParallel) -> Times:
    """Seconds per stage, the slowest rank's (the step waits for it)."""
    time_s = {"fetch": fetched.fetch_s, "fetch_wait": fetched.wait_s, **clock.times}
    if dp.enabled:
        time_s = {k: max(t[k] for t in dp.all_gather(time_s)) for k in time_s}
    return Times(**time_s)


def _route_bytes(fetched: FetchedBatch, totals: StepTotals) -> RouteBytes:
    # Each rank counts what it read itself (one rank per TP/CP group with stage reads).
    read = int(world_sum(np.array([fetched.route_bytes], np.int64))[0])
    stored = int(totals.stored_route_bytes)
    return RouteBytes(read, stored, read / stored if stored else 0.0)


@dataclass(frozen=True)
class StepContext:
    """What the report needs of the step besides its stages' results."""

    step: int
    mode: ReplayMode
    passes: Passes
    geometry: Geometry
    dp: DataParallel
    local_mini: int


def step_report(
    ctx: StepContext,
    fetched: FetchedBatch,
    laid: Laid,
    old: OldPass,
    compared: Comparison,
    updates: Updates,
    clock: Clock,
) -> StepReport:
    """The step's report from its stages' results, summed or maxed over every rank."""
    dp, layers = ctx.dp, list(ctx.geometry.moe_layers)
    losses, clips, aux_layers = updates.losses, updates.clips, updates.aux_layers
    if dp.enabled:
        losses, clips = dp.sum(losses).tolist(), dp.sum(clips).tolist()
        if aux_layers is not None:
            aux_layers = (dp.sum(aux_layers) / dp.size).tolist()
    totals = _totals(fetched, laid, old, updates, dp)
    route_bytes, time_s = _route_bytes(fetched, totals), _times(fetched, clock, dp)
    mass_n = totals.mass_tokens
    followed = None
    if ctx.mode is ReplayMode.R3:
        followed = replay_followed(world_sum(old.followed + updates.followed), layers)
    return StepReport(
        step=ctx.step,
        mode=ctx.mode.value,
        samples=int(totals.samples),
        reward_mean=float(np.mean(laid.rewards)) if laid.rewards else 0.0,
        expected_reward=totals.mass_sum / mass_n if mass_n else 0.0,
        entropy=totals.entropy_sum / mass_n if mass_n else 0.0,
        loss=float(np.mean(losses)),
        clip_fraction=float(np.mean(clips)),
        update_agreement=updates.drift,
        rows=_rows(totals, ctx.passes.update is not Routing.NATURAL),
        missing_records=int(totals.missing),
        dropped_samples=int(totals.dropped),
        route_bytes=route_bytes,
        time_s=time_s,
        gap=gaps(laid, old, compared, ctx.passes, dp, ctx.local_mini),
        agreement=agreement(compared.agree, layers, ctx.geometry.topk),
        replay_followed=followed,
        aux_loss=float(np.mean(aux_layers)) if aux_layers else None,
        aux_loss_layers=aux_layers,
        grad_norm=updates.grad_norm,
    )
