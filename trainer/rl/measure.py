"""What a step measures, with its totals named: routing counts per layer, the step's sums over
the data-parallel ranks, and megatron's aux loss.

Counts are taken where the routers run, on each rank's rows and layers, and summed over every
rank: each (row, layer) lives on exactly one rank of a data-parallel rank's model group.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

import numpy as np
import torch
import torch.distributed as dist

from trainer.report.step_report import Agreement, ReplayFollowed


def count_same(
    routes: dict, reference: dict[int, torch.Tensor], key: str, columns: dict[int, int]
) -> np.ndarray:
    """int64 ``[moe layers, 3]``: per layer, rows whose ``key`` top-k set equals the
    reference's, the experts both share summed over rows, and the rows compared (rows
    ``MASKED`` in the reference skipped), over this rank's rows and routers.

    Args:
        routes: Per router layer, what its router did (``{"natural": ids, "used": ids}``).
        reference: Per router layer, the ids to compare with, ``[rows, topk]``.
        key: Which of ``routes``' ids to compare.
        columns: Global MoE layer number -> its row in the result.
    """
    out = np.zeros((len(columns), 3), np.int64)
    for layer, ref in reference.items():
        got = routes[layer][key]
        rows = ref[:, 0] >= 0
        a, b = got[rows].sort(-1).values, ref[rows].sort(-1).values
        shared = (a[:, :, None] == b[:, None, :]).any(-1).sum(-1)
        out[columns[layer]] = (int((a == b).all(-1).sum()), int(shared.sum()), int(rows.sum()))
    return out


def world_sum(counts: np.ndarray) -> np.ndarray:
    """Summed over every rank (each row and layer is counted by one rank)."""
    if dist.is_initialized() and dist.get_world_size() > 1:
        total = torch.from_numpy(counts)
        dist.all_reduce(total)
        return total.numpy()
    return counts


def same_fraction(counts: np.ndarray) -> float:
    """Mean over layers with compared rows of the fraction whose top-k set was the same."""
    fractions = [same / rows for same, _, rows in counts if rows]
    return float(np.mean(fractions)) if fractions else 1.0


def agreement(counts: np.ndarray, layers: list[int], topk: int) -> Agreement:
    """The routing agreement from ``count_same``'s totals (every rank's)."""
    rows = int(counts[0, 2]) if counts.size else 0
    return Agreement(
        layers=list(layers),
        exact=[float(s / n) for s, _, n in counts] if rows else [],
        overlap=[float(o / (topk * n)) for _, o, n in counts] if rows else [],
        rows=rows,
    )


def replay_followed(counts: np.ndarray, layers: list[int]) -> ReplayFollowed:
    """Per MoE layer, the fraction of rows with a record route whose experts, as megatron's
    routing map sent them, are exactly the record's (every rank's rows summed)."""
    return ReplayFollowed(
        layers=list(layers),
        exact=[float(same / rows) if rows else 1.0 for same, _, rows in counts],
        rows=[int(rows) for rows in counts[:, 2]],
    )


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
