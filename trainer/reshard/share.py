"""One rank's whole share of a micro-batch: steps 2 and 4-6 applied to routes, token ids or
position ids, and megatron's per-router tensors (step 7)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from routereplay.domain.record import MASKED
from trainer.reshard.layers import PipelineSplit, layer_columns, stage_moe_layers
from trainer.reshard.layout import ROUTE_DTYPE, Layout, LayoutError, RankCoords
from trainer.reshard.packing import PackPlan, cp_index, cp_packed_index, sp_slice


def shard_packed(packed: np.ndarray, plan: PackPlan, layout: Layout, coords: RankCoords):
    """One packed micro-batch ``[plan.total, ...]`` -> this rank's rows: CP chunks per
    sequence, then this TP rank's sequence-parallel share of the CP-local rows.

    Works for routes (``pack_routes``), token ids and position ids alike.
    """
    if layout.multiple > 1 and (plan.padded_lengths % layout.multiple).any():
        raise LayoutError(
            f"packed sequences must be padded to a multiple of {layout.multiple} for {layout}"
        )
    local = packed
    if layout.cp > 1:
        local = packed[cp_packed_index(plan, layout.cp, coords.cp_rank)]
    if layout.sequence_parallel and layout.tp > 1:
        local = local[sp_slice(local.shape[0], layout.tp, coords.tp_rank)]
    return local


def shard_padded(x, seq: int, layout: Layout, coords: RankCoords):
    """A padded batch's rows in megatron order ``[seq * batch, ...]`` -> this rank's rows:
    CP chunks along ``seq``, then the SP share of the CP-local ``[seq / cp * batch]`` rows
    (megatron scatters ``[seq, batch, hidden]`` along seq, so rows stay seq-major)."""
    batch = x.shape[0] // seq
    if seq * batch != x.shape[0]:
        raise LayoutError(f"{x.shape[0]} rows are not seq={seq} x a batch size")
    if seq % layout.multiple:
        raise LayoutError(f"seq={seq} must be a multiple of {layout.multiple} for {layout}")
    local = x
    if layout.cp > 1:
        view = x.reshape(seq, batch, *x.shape[1:])
        idx = cp_index(seq, layout.cp, coords.cp_rank)
        local = view[torch.from_numpy(idx) if isinstance(x, torch.Tensor) else idx]
        local = local.reshape(-1, *x.shape[1:])
    if layout.sequence_parallel and layout.tp > 1:
        local = local[sp_slice(local.shape[0], layout.tp, coords.tp_rank)]
    return local


def router_tensors(local: np.ndarray | torch.Tensor) -> list[torch.Tensor]:
    """``[tokens, L', k]`` routes of this rank -> megatron's per-router int64 ``[tokens, k]``
    tensors (``RouterReplayControl.load``), in column order."""
    t = torch.as_tensor(local)
    return [t[:, j].to(torch.int64).contiguous() for j in range(t.shape[1])]


def reshard_packed_routes(
    routes: Sequence[np.ndarray],
    lengths: Sequence[int],
    moe_layers: Sequence[int],
    split: PipelineSplit,
    layout: Layout,
    coords: RankCoords,
) -> tuple[np.ndarray, PackPlan, tuple[int, ...]]:
    """One packed micro-batch's routes for one rank: this stage's layers, packed, CP, SP.

    Args:
        routes: Per sequence the record's ``[T_i - 1, L, k]`` routes (this micro-batch's
            sequences, in their packed order).
        lengths: ``T_i`` per sequence.
        moe_layers: The records' ``Geometry.moe_layers``.
        split: The model's pipeline split.
        layout: The parallel layout; coords: this rank.

    Returns:
        ``(local, plan, layers)``: ``ROUTE_DTYPE`` ``[local_tokens, len(layers), k]``, the
        packing plan of the whole micro-batch, and the stage's MoE layers.
    """
    layers = stage_moe_layers(split, moe_layers, coords.pp_rank, coords.vp_stage)
    columns = layer_columns(moe_layers, layers)
    plan = PackPlan.build(lengths, layout.multiple)
    for i, r in enumerate(routes):
        if r.shape[0] != plan.lengths[i] - 1:
            raise LayoutError(
                f"sequence {i}: {r.shape[0]} route rows for {int(plan.lengths[i])} tokens"
            )
    # The packed rows this rank keeps (CP chunks, then its SP share), gathered straight from
    # each record: the same rows as shard_packed(pack_routes(...)) without packing the rest.
    rows = local_packed_rows(plan, layout, coords)
    k = routes[0].shape[2] if routes else 0
    out = np.empty((rows.size, len(layers), k), dtype=ROUTE_DTYPE)
    if not layers:
        return out, plan, layers
    seq = np.searchsorted(plan.cu_seqlens_padded, rows, side="right") - 1
    offset = rows - plan.cu_seqlens_padded[seq]
    # A stage's layers are usually consecutive record columns: a slice is a view, no copy.
    if list(columns) == list(range(columns[0], columns[-1] + 1)):
        cols = slice(columns[0], columns[-1] + 1)
    else:
        cols = np.asarray(columns)
    bounds = np.searchsorted(seq, np.arange(plan.lengths.size + 1))  # rows are seq-sorted
    for i, r in enumerate(routes):
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        if lo == hi:
            continue  # none of this sequence's rows are on this rank
        off = offset[lo:hi]
        # This rank's rows of one sequence form a few runs of consecutive offsets (one per CP
        # chunk, cut by the SP share): copy each run's recorded prefix as a block; the rest
        # (the final token, padding) is MASKED.
        starts = np.concatenate([[0], np.flatnonzero(np.diff(off) != 1) + 1, [hi - lo]])
        for a, b in zip(starts[:-1], starts[1:], strict=True):
            first = int(off[a])
            n = max(0, min(int(b - a), r.shape[0] - first))
            if n:
                out[lo + a : lo + a + n] = r[first : first + n, cols]
            out[lo + a + n : lo + b] = MASKED
    return out, plan, layers


def local_packed_rows(plan: PackPlan, layout: Layout, coords: RankCoords) -> np.ndarray:
    """int64: the packed rows (``[0, plan.total)``) one rank keeps, in its local order."""
    rows = np.arange(plan.total, dtype=np.int64)
    return np.asarray(shard_packed(rows, plan, layout, coords))
