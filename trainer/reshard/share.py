"""One rank's share of a micro-batch's rows: steps 5 and 6 applied to the rows of a batch in
megatron's token order (replay ids, masks)."""

from __future__ import annotations

import torch

from trainer.reshard.layout import Layout, LayoutError, RankCoords
from trainer.reshard.packing import cp_index, sp_slice


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
