"""Routing counts per MoE layer: taken where the routers run, on each rank's rows and layers,
and summed over every rank (each (row, layer) lives on exactly one rank of a data-parallel
rank's model group); the agreement and ``replay_followed`` of the report are made from them."""

from __future__ import annotations

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


def no_counts(layers: int) -> np.ndarray:
    """``count_same``'s zeros for ``layers`` MoE layers."""
    return np.zeros((layers, 3), np.int64)
