"""Packing, context parallel and sequence parallel (steps 4-6): where each sequence of a packed
micro-batch sits, and which rows of a sequence one CP rank and one SP rank keep."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from trainer.sharding.parallel import ParallelismError

# --------------------------------------------------------------------------------------------
# 4. Packing


@dataclass(frozen=True)
class PackPlan:
    """Where each sequence sits in a packed micro-batch (``PaddedBatch.packed``: one row).

    Attributes:
        lengths: int64 ``[n]`` real tokens per sequence.
        cu_seqlens: int64 ``[n + 1]`` cumulative real lengths (megatron's ``cu_seqlens``).
        cu_seqlens_padded: int64 ``[n + 1]`` cumulative padded lengths; sequence i occupies
            packed rows ``[cu_seqlens_padded[i], cu_seqlens_padded[i + 1])``, its real tokens
            first.
    """

    lengths: np.ndarray
    cu_seqlens: np.ndarray
    cu_seqlens_padded: np.ndarray

    @classmethod
    def build(cls, lengths: Sequence[int], multiple: int = 1) -> PackPlan:
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.ndim != 1 or lengths.size == 0 or (lengths < 1).any():
            raise ParallelismError(f"sequence lengths must be positive, got {lengths.tolist()}")
        padded = -(-lengths // multiple) * multiple
        zero = np.zeros(1, np.int64)
        return cls(
            lengths,
            np.concatenate([zero, lengths.cumsum()]),
            np.concatenate([zero, padded.cumsum()]),
        )

    @property
    def total(self) -> int:
        """Packed rows, padding included."""
        return int(self.cu_seqlens_padded[-1])


# --------------------------------------------------------------------------------------------
# 5. Context parallel


def cp_index(seq_len: int, cp_size: int, cp_rank: int) -> np.ndarray:
    """int64 ``[seq_len / cp_size]``: the positions one CP rank keeps of a sequence.

    The sequence is cut into ``2 * cp_size`` equal chunks; rank r keeps chunk r, then chunk
    ``2 * cp_size - 1 - r`` (causal attention's load balance).

    Raises:
        ParallelismError: ``seq_len`` not a multiple of ``2 * cp_size``.
    """
    if not 0 <= cp_rank < cp_size:
        raise ParallelismError(f"cp_rank {cp_rank} outside [0, {cp_size})")
    if cp_size == 1:
        return np.arange(seq_len, dtype=np.int64)
    chunks = 2 * cp_size
    if seq_len % chunks:
        raise ParallelismError(
            f"a sequence of {seq_len} tokens does not split into 2 x cp = {chunks} chunks; pad "
            "it to a multiple of tp x cp x 2"
        )
    c = seq_len // chunks
    first = np.arange(cp_rank * c, (cp_rank + 1) * c)
    second = np.arange((chunks - 1 - cp_rank) * c, (chunks - cp_rank) * c)
    return np.concatenate([first, second]).astype(np.int64)


# --------------------------------------------------------------------------------------------
# 6. Sequence parallel


def sp_slice(num_rows: int, tp_size: int, tp_rank: int) -> slice:
    """This TP rank's contiguous rows of a sequence-parallel region of ``num_rows`` rows
    (megatron's scatter along the first dimension of ``[seq, batch, hidden]``, i.e. of the
    flattened ``[seq * batch]`` token rows)."""
    if not 0 <= tp_rank < tp_size:
        raise ParallelismError(f"tp_rank {tp_rank} outside [0, {tp_size})")
    if num_rows % tp_size:
        raise ParallelismError(
            f"{num_rows} rows do not split over {tp_size} sequence-parallel ranks; pad the "
            "sequence to a multiple of tp"
        )
    per = num_rows // tp_size
    return slice(tp_rank * per, (tp_rank + 1) * per)
