"""The trainer's padded batch layout and the model inputs it implies."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

PADDING_SIDES = ("right", "left")


@dataclass(frozen=True)
class PaddedBatch:
    """Samples padded to one length, left or right.

    Attributes:
        sample_ids: One id per sample (the route cache's keys).
        token_ids: int64 ``[batch, seq]``; padding columns hold ``pad_id``.
        lengths: int64 ``[batch]``, real tokens per sample.
        padding_side: ``"right"`` (tokens start at column 0) or ``"left"`` (tokens end at the
            last column).
    """

    sample_ids: tuple[str, ...]
    token_ids: torch.Tensor
    lengths: torch.Tensor
    padding_side: str

    @classmethod
    def from_samples(
        cls,
        sample_ids: Sequence[str],
        tokens: Sequence[np.ndarray | Sequence[int]],
        *,
        padding_side: str = "right",
        pad_id: int = 0,
        max_length: int | None = None,
    ) -> PaddedBatch:
        """Pad per-sample token ids to ``max_length`` (default: the longest sample)."""
        if padding_side not in PADDING_SIDES:
            raise ValueError(f"padding_side {padding_side!r}; expected one of {PADDING_SIDES}")
        if len(sample_ids) != len(tokens):
            raise ValueError(f"{len(sample_ids)} sample ids for {len(tokens)} token lists")
        lengths = [len(t) for t in tokens]
        seq = max(lengths) if max_length is None else max_length
        if max(lengths) > seq:
            raise ValueError(f"a sample has {max(lengths)} tokens; max_length is {seq}")
        ids = torch.full((len(tokens), seq), pad_id, dtype=torch.int64)
        for b, t in enumerate(tokens):
            start = 0 if padding_side == "right" else seq - len(t)
            ids[b, start : start + len(t)] = torch.as_tensor(np.asarray(t, dtype=np.int64))
        return cls(tuple(sample_ids), ids, torch.tensor(lengths, dtype=torch.int64), padding_side)

    @property
    def batch_size(self) -> int:
        return self.token_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.token_ids.shape[1]

    @property
    def starts(self) -> torch.Tensor:
        """int64 ``[batch]``: the column of each sample's first token."""
        if self.padding_side == "right":
            return torch.zeros_like(self.lengths)
        return self.seq_len - self.lengths

    @property
    def valid(self) -> torch.Tensor:
        """bool ``[batch, seq]``: True on real tokens."""
        cols = torch.arange(self.seq_len)
        starts = self.starts[:, None]
        return (cols >= starts) & (cols < starts + self.lengths[:, None])

    def sample_tokens(self, b: int) -> torch.Tensor:
        """int64 ``[lengths[b]]``: sample ``b``'s real tokens."""
        start = int(self.starts[b])
        return self.token_ids[b, start : start + int(self.lengths[b])]

    def position_ids(self) -> torch.Tensor:
        """int64 ``[batch, seq]``: 0 at each sample's first token (0 on left padding too)."""
        pos = torch.arange(self.seq_len)[None, :] - self.starts[:, None]
        return pos.clamp(min=0)

    def attention_mask(self) -> torch.Tensor:
        """bool ``[batch, 1, seq, seq]``, True where attention is *blocked* (megatron's sense):
        causal, and padding keys hidden. A padding query still sees itself, so no row is fully
        masked. Passed explicitly because megatron's default causal mask is built on CUDA."""
        seq = self.seq_len
        causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        blocked = causal[None] | ~self.valid[:, None, :]
        blocked &= ~torch.eye(seq, dtype=torch.bool)[None]
        return blocked[:, None]
