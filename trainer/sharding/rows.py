"""One rank's share of a micro-batch's rows: steps 5 and 6 applied to the rows of a batch in
megatron's token order (replay ids, masks)."""

from __future__ import annotations

import numpy as np
import torch

from trainer.sharding.packing import cp_index, sp_slice
from trainer.sharding.parallel import Parallelism, ParallelismError, RankCoords


def rank_positions(seq: int, parallelism: Parallelism, coords: RankCoords) -> np.ndarray:
    """The sequence positions whose rows this rank keeps, in its order: its CP chunks, then
    its SP share of them. Whole positions: ``seq`` is a multiple of the parallel sizes' multiple, so
    megatron's scatter of the seq-major ``[seq / cp * batch]`` rows cuts between positions."""
    if seq % parallelism.multiple:
        raise ParallelismError(
            f"seq={seq} must be a multiple of {parallelism.multiple} for {parallelism}"
        )
    positions = cp_index(seq, parallelism.cp, coords.cp_rank)
    if parallelism.sequence_parallel and parallelism.tp > 1:
        positions = positions[sp_slice(len(positions), parallelism.tp, coords.tp_rank)]
    return positions


def shard_padded(x, seq: int, parallelism: Parallelism, coords: RankCoords):
    """A padded batch's rows in megatron order ``[seq * batch, ...]`` -> this rank's rows (those
    of its ``rank_positions``; a view where they are one run)."""
    batch = x.shape[0] // seq
    if seq * batch != x.shape[0]:
        raise ParallelismError(f"{x.shape[0]} rows are not seq={seq} x a batch size")
    positions = rank_positions(seq, parallelism, coords)
    view = x.reshape(seq, batch, *x.shape[1:])
    first = int(positions[0])
    if np.array_equal(positions, np.arange(first, first + len(positions))):
        local = view[first : first + len(positions)]
    else:
        local = view[torch.from_numpy(positions) if isinstance(x, torch.Tensor) else positions]
    return local.reshape(-1, *x.shape[1:])
