"""The trainer's batch layouts (padded or packed) and the model inputs they imply."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from trainer.config import PaddingSide
from trainer.sharding import PackPlan

PACKED = "packed"


@dataclass(frozen=True)
class PaddedBatch:
    """Samples laid out in a ``[rows, seq]`` token tensor: one sample per row padded to one
    length (left or right), or every sample packed back to back in one row (THD: remove-padding),
    each padded to a multiple of the layout's.

    Attributes:
        sample_ids: One id per sample (the route cache's keys).
        token_ids: int64 ``[rows, seq]``; padding columns hold ``pad_id``.
        lengths: int64 ``[batch]``, real tokens per sample.
        padding_side: ``"right"`` (tokens start at column 0), ``"left"`` (tokens end at the
            last column) or ``"packed"`` (row 0, from ``packed_starts``).
        packed_starts: int64 ``[batch]``, packed only: the column of each sample's first token
            (megatron's ``cu_seqlens_padded[:-1]``).
    """

    sample_ids: tuple[str, ...]
    token_ids: torch.Tensor
    lengths: torch.Tensor
    padding_side: str
    packed_starts: torch.Tensor | None = None

    @classmethod
    def from_samples(
        cls,
        sample_ids: Sequence[str],
        tokens: Sequence[np.ndarray | Sequence[int]],
        *,
        padding_side: PaddingSide | str = PaddingSide.RIGHT,
        pad_id: int = 0,
        max_length: int | None = None,
        num_rows: int | None = None,
    ) -> PaddedBatch:
        """Pad per-sample token ids to ``max_length`` (default: the longest sample); with
        ``num_rows``, empty rows follow the samples' (a fixed micro-batch shape)."""
        if padding_side not in set(PaddingSide):
            raise ValueError(
                f"padding_side {padding_side!r}; expected one of {[p.value for p in PaddingSide]}"
            )
        if len(sample_ids) != len(tokens):
            raise ValueError(f"{len(sample_ids)} sample ids for {len(tokens)} token lists")
        lengths = [len(t) for t in tokens]
        seq = max(lengths) if max_length is None else max_length
        if max(lengths) > seq:
            raise ValueError(f"a sample has {max(lengths)} tokens; max_length is {seq}")
        ids = torch.full((max(num_rows or 0, len(tokens)), seq), pad_id, dtype=torch.int64)
        for b, t in enumerate(tokens):
            start = 0 if padding_side == PaddingSide.RIGHT else seq - len(t)
            ids[b, start : start + len(t)] = torch.as_tensor(np.asarray(t, dtype=np.int64))
        return cls(tuple(sample_ids), ids, torch.tensor(lengths, dtype=torch.int64), padding_side)

    @classmethod
    def packed(
        cls,
        sample_ids: Sequence[str],
        tokens: Sequence[np.ndarray | Sequence[int]],
        *,
        multiple: int = 1,
        pad_id: int = 0,
        max_length: int | None = None,
    ) -> PaddedBatch:
        """Pack samples back to back in one row, each padded to a multiple of ``multiple``
        (``sharding.PackPlan``), the row padded to ``max_length`` when given."""
        if len(sample_ids) != len(tokens):
            raise ValueError(f"{len(sample_ids)} sample ids for {len(tokens)} token lists")
        plan = PackPlan.build([len(t) for t in tokens], multiple)
        ids = torch.full((1, max(max_length or 0, plan.total)), pad_id, dtype=torch.int64)
        for start, t in zip(plan.cu_seqlens_padded[:-1], tokens, strict=True):
            ids[0, start : start + len(t)] = torch.as_tensor(np.asarray(t, dtype=np.int64))
        return cls(
            tuple(sample_ids),
            ids,
            torch.from_numpy(plan.lengths.copy()),
            PACKED,
            torch.from_numpy(plan.cu_seqlens_padded[:-1].copy()),
        )

    @property
    def batch_size(self) -> int:
        """Samples in the batch."""
        return len(self.sample_ids)

    @property
    def num_rows(self) -> int:
        """Rows of ``token_ids`` (megatron's micro-batch size: 1 when packed)."""
        return self.token_ids.shape[0]

    @property
    def rows(self) -> torch.Tensor:
        """int64 ``[batch]``: the row of each sample."""
        if self.packed_starts is not None:
            return torch.zeros_like(self.lengths)
        return torch.arange(self.batch_size)

    @property
    def seq_len(self) -> int:
        return self.token_ids.shape[1]

    @property
    def starts(self) -> torch.Tensor:
        """int64 ``[batch]``: the column of each sample's first token."""
        if self.packed_starts is not None:
            return self.packed_starts
        if self.padding_side == PaddingSide.RIGHT:
            return torch.zeros_like(self.lengths)
        return self.seq_len - self.lengths

    def segments(self) -> torch.Tensor:
        """int64 ``[rows, seq]``: the sample each column holds, -1 on padding."""
        out = torch.full(self.token_ids.shape, -1, dtype=torch.int64)
        for b, (row, start, n) in enumerate(zip(self.rows, self.starts, self.lengths, strict=True)):
            out[row, start : start + n] = b
        return out

    @property
    def valid(self) -> torch.Tensor:
        """bool ``[rows, seq]``: True on real tokens."""
        return self.segments() >= 0

    def sample_tokens(self, b: int) -> torch.Tensor:
        """int64 ``[lengths[b]]``: sample ``b``'s real tokens."""
        start = int(self.starts[b])
        return self.token_ids[int(self.rows[b]), start : start + int(self.lengths[b])]

    def sample_values(self, values: torch.Tensor, b: int) -> torch.Tensor:
        """Sample ``b``'s columns of a ``[rows, seq, ...]`` tensor (``[lengths[b], ...]``)."""
        start = int(self.starts[b])
        return values[int(self.rows[b]), start : start + int(self.lengths[b])]

    def position_ids(self) -> torch.Tensor:
        """int64 ``[rows, seq]``: 0 at each sample's first token (0 on padding too); packed
        samples each count from 0."""
        pos = torch.zeros(self.token_ids.shape, dtype=torch.int64)
        for row, start, n in zip(self.rows, self.starts, self.lengths, strict=True):
            pos[row, start : start + n] = torch.arange(int(n))
        if self.packed_starts is None and self.padding_side == PaddingSide.RIGHT:
            # Right padding continues counting (what the padded layout always gave).
            pos = torch.arange(self.seq_len).expand(self.num_rows, -1).clone()
        return pos

    def attention_mask(self) -> torch.Tensor:
        """bool ``[rows, 1, seq, seq]``, True where attention is *blocked* (megatron's sense):
        causal within each sample, padding keys hidden; packed samples see only themselves (a
        block-diagonal causal mask: the THD attention's maths without TransformerEngine). A
        padding query still sees itself, so no row is fully masked. Passed explicitly because
        megatron's default causal mask is built on CUDA."""
        seq = self.seq_len
        seg = self.segments()
        causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        blocked = causal[None] | (seg[:, None, :] < 0)
        if self.packed_starts is not None:
            blocked |= seg[:, :, None] != seg[:, None, :]
        blocked &= ~torch.eye(seq, dtype=torch.bool)[None]
        return blocked[:, None]
