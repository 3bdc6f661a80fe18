"""Packing, context parallel and sequence parallel (steps 4-6): where each token of a packed
(THD) micro-batch sits, and which rows one CP rank and one SP rank keep."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from routereplay.domain.record import MASKED
from trainer.reshard.layout import ROUTE_DTYPE, LayoutError

# --------------------------------------------------------------------------------------------
# 4. Packing (THD)


@dataclass(frozen=True)
class PackPlan:
    """Where each sequence sits in a packed (THD) micro-batch.

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
            raise LayoutError(f"sequence lengths must be positive, got {lengths.tolist()}")
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

    @property
    def padded_lengths(self) -> np.ndarray:
        return np.diff(self.cu_seqlens_padded)

    @property
    def max_seqlen(self) -> int:
        return int(self.padded_lengths.max())

    def valid(self) -> np.ndarray:
        """bool ``[total]``: True on real tokens."""
        out = np.zeros(self.total, dtype=bool)
        for start, n in zip(self.cu_seqlens_padded[:-1], self.lengths, strict=True):
            out[start : start + n] = True
        return out

    def position_ids(self) -> np.ndarray:
        """int64 ``[total]``: 0 at each sequence's first token, counting on through its
        padding (what megatron's THD batches carry)."""
        starts = np.repeat(self.cu_seqlens_padded[:-1], self.padded_lengths)
        return np.arange(self.total, dtype=np.int64) - starts


def pack_rows(rows: Sequence[np.ndarray], plan: PackPlan, fill) -> np.ndarray:
    """Concatenate per-sequence arrays along axis 0 at the plan's padded offsets.

    Args:
        rows: Per sequence ``[r_i, ...]`` with ``r_i <= lengths[i]`` (tokens: ``r_i = T_i``;
            a record's routes: ``r_i = T_i - 1``, so the final token stays ``fill``).
        plan: The packing plan.
        fill: Value of every row not given (padding, the final tokens' routes).

    Returns:
        ``[plan.total, ...]`` with ``rows``' trailing shape and dtype.
    """
    if len(rows) != plan.lengths.size:
        raise LayoutError(f"{len(rows)} sequences for a plan of {plan.lengths.size}")
    first = np.asarray(rows[0])
    out = np.full((plan.total, *first.shape[1:]), fill, dtype=first.dtype)
    for i, r in enumerate(rows):
        if r.shape[0] > plan.lengths[i] or r.shape[1:] != first.shape[1:]:
            raise LayoutError(
                f"sequence {i}: {tuple(r.shape)} rows for {int(plan.lengths[i])} tokens"
            )
        start = int(plan.cu_seqlens_padded[i])
        out[start : start + r.shape[0]] = r
    return out


def pack_routes(
    routes: Sequence[np.ndarray], plan: PackPlan, columns: Sequence[int] | None = None
) -> np.ndarray:
    """Pack records' routes exactly as their tokens: ``ROUTE_DTYPE`` ``[plan.total, L', k]``.

    Args:
        routes: Per sequence a record's ``[T_i - 1, L, k]`` (uint8 / uint16).
        plan: Built from the sequences' token counts ``T_i``.
        columns: Record columns to keep (this stage's layers); all when None.

    Row ``cu_seqlens_padded[i] + j`` is token j of sequence i; each final token and all padding
    are ``MASKED``.
    """
    for i, r in enumerate(routes):
        if r.shape[0] != plan.lengths[i] - 1:
            raise LayoutError(
                f"sequence {i}: {r.shape[0]} route rows for {int(plan.lengths[i])} tokens "
                "(a record has one row per token but the last)"
            )
    sel = [r if columns is None else r[:, columns] for r in routes]
    return pack_rows([r.astype(ROUTE_DTYPE, copy=False) for r in sel], plan, MASKED)


def unpack_rows(packed: np.ndarray, plan: PackPlan, rows: Sequence[int] | None = None) -> list:
    """Inverse of ``pack_rows``: per sequence its first ``rows[i]`` (default: all real) rows."""
    rows = plan.lengths if rows is None else rows
    return [
        packed[int(s) : int(s) + int(n)]
        for s, n in zip(plan.cu_seqlens_padded[:-1], rows, strict=True)
    ]


# --------------------------------------------------------------------------------------------
# 5. Context parallel


def cp_index(seq_len: int, cp_size: int, cp_rank: int) -> np.ndarray:
    """int64 ``[seq_len / cp_size]``: the positions one CP rank keeps of a sequence.

    The sequence is cut into ``2 * cp_size`` equal chunks; rank r keeps chunk r, then chunk
    ``2 * cp_size - 1 - r`` (causal attention's load balance).

    Raises:
        LayoutError: ``seq_len`` not a multiple of ``2 * cp_size``.
    """
    if not 0 <= cp_rank < cp_size:
        raise LayoutError(f"cp_rank {cp_rank} outside [0, {cp_size})")
    if cp_size == 1:
        return np.arange(seq_len, dtype=np.int64)
    chunks = 2 * cp_size
    if seq_len % chunks:
        raise LayoutError(
            f"a sequence of {seq_len} tokens does not split into 2 x cp = {chunks} chunks; pad "
            "it to a multiple of tp x cp x 2"
        )
    c = seq_len // chunks
    first = np.arange(cp_rank * c, (cp_rank + 1) * c)
    second = np.arange((chunks - 1 - cp_rank) * c, (chunks - cp_rank) * c)
    return np.concatenate([first, second]).astype(np.int64)


def cp_packed_index(plan: PackPlan, cp_size: int, cp_rank: int) -> np.ndarray:
    """int64: the packed rows one CP rank keeps, sequence by sequence (``cp_index`` applied to
    each padded sequence), in packed order."""
    parts = [
        int(start) + cp_index(int(n), cp_size, cp_rank)
        for start, n in zip(plan.cu_seqlens_padded[:-1], plan.padded_lengths, strict=True)
    ]
    return np.concatenate(parts)


def cp_local_plan(plan: PackPlan, cp_size: int) -> np.ndarray:
    """int64 ``[n + 1]``: cumulative padded lengths of the CP-local packed sequence (each
    sequence keeps ``padded / cp`` rows on every CP rank)."""
    return plan.cu_seqlens_padded // cp_size


# --------------------------------------------------------------------------------------------
# 6. Sequence parallel


def sp_slice(num_rows: int, tp_size: int, tp_rank: int) -> slice:
    """This TP rank's contiguous rows of a sequence-parallel region of ``num_rows`` rows
    (megatron's scatter along the first dimension of ``[seq, batch, hidden]``, i.e. of the
    flattened ``[seq * batch]`` token rows)."""
    if not 0 <= tp_rank < tp_size:
        raise LayoutError(f"tp_rank {tp_rank} outside [0, {tp_size})")
    if num_rows % tp_size:
        raise LayoutError(
            f"{num_rows} rows do not split over {tp_size} sequence-parallel ranks; pad the "
            "sequence to a multiple of tp"
        )
    per = num_rows // tp_size
    return slice(tp_rank * per, (tp_rank + 1) * per)
