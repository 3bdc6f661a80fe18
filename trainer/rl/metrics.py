"""The consistency report's measurements: how close the trainer comes to the rollout.

- Routing agreement, per MoE layer: the fraction of tokens (rows of the records) whose
  trainer-natural top-k set equals the rollout's (``routereplay.domain.route_stats.agreement``).
- Log-prob gap over generated tokens, trainer against rollout, with d = logp_trainer -
  logp_rollout: mean |d|, max |d|, the k3 estimate of KL(rollout || trainer),
  mean(exp(d) - 1 - d) (the samples come from the rollout policy), and the fraction of tokens
  whose probability ratio exceeds 2 either way (|d| > ln 2).
- ``NaturalTopk``: the top-k a router would choose on its current logits, captured in any pass
  (natural or replayed), by wrapping each router's ``gating`` for the forward's duration.
- ``recorded_routes``: the reference of ``replay_followed``, the record's row of the token each
  router row holds, found from the model's own inputs rather than from the replay ids.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass

import numpy as np
import torch

from routereplay.domain.record import MASKED, Record
from routereplay.domain.route_stats import agreement, overlap_counts
from trainer.layout.batch import PaddedBatch


@dataclass
class LogprobGap:
    """Trainer against rollout log-probs over ``tokens`` generated tokens."""

    mean_abs: float
    max_abs: float
    k3_kl: float
    ratio_gt_2: float
    tokens: int

    def as_dict(self) -> dict:
        return asdict(self)


def logprob_gap(trainer: np.ndarray, rollout: np.ndarray) -> LogprobGap:
    """Gap between two float arrays of the same generated tokens' log-probs."""
    d = np.asarray(trainer, np.float64) - np.asarray(rollout, np.float64)
    if d.size == 0:
        return LogprobGap(0.0, 0.0, 0.0, 0.0, 0)
    return LogprobGap(
        float(np.abs(d).mean()),
        float(np.abs(d).max()),
        float((np.expm1(d) - d).mean()),
        float((np.abs(d) > math.log(2)).mean()),
        int(d.size),
    )


def routing_agreement(
    natural: Sequence[np.ndarray], rollout: Sequence[np.ndarray]
) -> dict[str, list[float] | int]:
    """Per MoE layer agreement of per-sample ``[rows, L, k]`` routes: exact top-k set equality
    and mean overlap, over every row of every sample."""
    result = agreement(list(zip(natural, rollout, strict=True)))
    return {
        "exact": [float(x) for x in result.exact],
        "overlap": [float(x) for x in result.overlap],
        "rows": int(result.rows),
    }


def agreement_counts(natural: Sequence[np.ndarray], rollout: Sequence[np.ndarray]) -> np.ndarray:
    """int64 ``[rows, L]``: per compared row and layer, how many of the k experts both picked
    (the rows ``routing_agreement`` averages; concatenable across ranks)."""
    counts = [
        overlap_counts(a[: min(len(a), len(b))], b[: min(len(a), len(b))])
        for a, b in zip(natural, rollout, strict=True)
    ]
    return np.concatenate(counts) if counts else np.zeros((0, 0), np.int64)


def natural_choice(router, logits: torch.Tensor) -> torch.Tensor:
    """The experts megatron's ``router`` chooses for ``logits`` without replay.

    Args:
        router: A megatron ``TopKRouter`` (its config and expert bias are used).
        logits: ``[tokens, experts]`` gating logits.

    Returns:
        int64 ``[tokens, k]``, ascending expert ids per token.
    """
    from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function

    config = router.config
    with torch.no_grad():
        _, routing_map = topk_routing_with_score_function(
            logits,
            config.moe_router_topk,
            use_pre_softmax=config.moe_router_pre_softmax,
            num_groups=config.moe_router_num_groups,
            group_topk=config.moe_router_group_topk,
            scaling_factor=config.moe_router_topk_scaling_factor,
            score_function=config.moe_router_score_function,
            expert_bias=router.expert_bias,
        )
    # The map's True entries, k per row, as ascending ids (stable sort keeps id order).
    order = torch.argsort(routing_map.to(torch.int8), dim=-1, descending=True, stable=True)
    return order[:, : config.moe_router_topk].sort(-1).values


class NaturalTopk:
    """Capture, per router and forward, the top-k of the router's current logits: what it
    would choose without replay (its natural routing), whatever it actually used.

    ``calls[j]`` lists int64 ``[tokens, k]`` tensors of router j (in ``routers`` order), one per
    call inside ``capture()``; recomputation in backward runs outside it and is not captured.
    The choice is megatron's own routing function on the logits (``natural_choice``), not their
    plain top-k: a sigmoid router with an expert bias and group-limited routing (GLM-4.5,
    DeepSeek-V3) chooses differently from its logits' top-k.
    """

    def __init__(self, routers, topk: int):
        self.routers = list(routers)
        self.topk = topk
        self.calls: list[list[torch.Tensor]] = [[] for _ in self.routers]

    @contextlib.contextmanager
    def capture(self) -> Iterator[NaturalTopk]:
        # An instance attribute already there (another wrapper) is restored on exit.
        previous = [r.router.__dict__.get("gating") for r in self.routers]
        for j, r in enumerate(self.routers):
            gating = r.router.gating

            def hooked(x, j=j, gating=gating):
                logits = gating(x)
                flat = logits.detach().reshape(-1, logits.shape[-1])
                self.calls[j].append(natural_choice(self.routers[j].router, flat))
                return logits

            r.router.gating = hooked
        try:
            yield self
        finally:
            for r, before in zip(self.routers, previous, strict=True):
                if before is None:
                    del r.router.gating
                else:
                    r.router.gating = before

    def last(self) -> list[torch.Tensor]:
        """The most recent call of every router, in router order."""
        return [calls[-1] for calls in self.calls]


def recorded_routes(
    batch: PaddedBatch,
    records: Sequence[Record | None],
    layers: Sequence[int],
    local: Callable[[torch.Tensor], torch.Tensor],
) -> dict[int, torch.Tensor]:
    """What each router row should have used under replay, straight from the records.

    Each cell of the batch is named by the model's own inputs: the sample it holds
    (``batch.segments()``) and its position id (``batch.position_ids()``, what the rotary
    embedding reads), token t of sample b. Its expected experts are row t of sample b's record
    (row t: computed with token t as the input). Neither ``align_routes`` nor the replay ids
    are read, so a fault in the alignment or in the cut of a rank's rows shows as a router
    row whose experts differ from the record's.

    Args:
        batch: One micro-batch's layout.
        records: One per sample of ``batch`` (None: no record); a layer-selected read holds
            ``layers``.
        layers: Global layer numbers of this rank's routers.
        local: This rank's share of a ``[seq, rows, ...]`` tensor, as megatron cuts the
            tokens (``RLStep._megatron_share``).

    Returns:
        Per layer, int64 ``[local tokens, k]`` in megatron's token order; ``MASKED`` rows
        have no recorded route (a sample's final token, padding, no record).
    """
    cells = torch.stack([batch.segments(), batch.position_ids()], dim=-1).transpose(0, 1)
    cells = local(cells.contiguous()).reshape(-1, 2).numpy()
    sample, position = cells[:, 0], cells[:, 1]
    out = {}
    for layer in layers:
        k = next((r.geometry.topk for r in records if r is not None), 1)
        ids = np.full((sample.size, k), MASKED, np.int64)
        for b, record in enumerate(records):
            if record is None:
                continue
            rows = np.flatnonzero((sample == b) & (position < record.num_rows))
            ids[rows] = record.routes[position[rows], record.moe_layers.index(layer)]
        out[layer] = torch.from_numpy(ids)
    return out
