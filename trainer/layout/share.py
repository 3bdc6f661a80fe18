"""This rank's share of a micro-batch: the rows its routers see (its context-parallel chunks,
then its sequence-parallel split), for replay ids and for the inputs megatron cuts itself."""

from __future__ import annotations

import numpy as np
import torch

from trainer.distributed.dp import ModelParallel
from trainer.layout.batch import PaddedBatch
from trainer.sharding import Parallelism, cp_index, rank_positions, shard_padded


class RankShare:
    """Cuts a micro-batch's per-token tensors to this rank's rows.

    Args:
        mp: This rank's model-parallel place (None: one rank holds every row).
    """

    def __init__(self, mp: ModelParallel | None):
        self.mp = mp
        self.parallelism = mp.parallelism if mp is not None else Parallelism()

    def positions(self, batch: PaddedBatch) -> np.ndarray | None:
        """The sequence positions whose rows this rank keeps (None: every one)."""
        if self.mp is None:
            return None
        return rank_positions(batch.seq_len, self.parallelism, self.mp.coords)

    def rows(self, batch: PaddedBatch, x):
        """This rank's rows of a micro-batch's rows in megatron order ``[seq * rows, ...]``
        (its sequence shard)."""
        if self.mp is None:
            return x
        return shard_padded(x, batch.seq_len, self.parallelism, self.mp.coords)

    def replayable(self, batch: PaddedBatch) -> torch.Tensor:
        """bool ``[local tokens]``: this rank's rows that have a route (a real token followed
        by one of the same sample), megatron order."""
        seg = batch.segments()
        ok = torch.zeros_like(seg, dtype=torch.bool)
        ok[:, :-1] = (seg[:, :-1] >= 0) & (seg[:, :-1] == seg[:, 1:])
        return self.rows(batch, ok.T.reshape(-1))

    def megatron_share(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of a ``[seq, rows, ...]`` tensor as megatron cuts the tokens:
        its sequence-parallel split of the embeddings (``scatter_to_sequence_parallel_region``,
        along seq) after the context-parallel chunks (cut before the model, as the tokens
        are: ``cp_index``; CP needs TransformerEngine, so that path does not run here).

        Megatron's own split, not ``rows``: ``replay_followed`` finds each router row's record
        route through it, independently of the replay ids."""
        if self.mp is None:
            return x
        if self.parallelism.cp > 1:
            x = x[
                torch.from_numpy(cp_index(x.shape[0], self.parallelism.cp, self.mp.coords.cp_rank))
            ]
        if self.parallelism.sequence_parallel and self.parallelism.tp > 1:
            from megatron.core.tensor_parallel import scatter_to_sequence_parallel_region

            x = scatter_to_sequence_parallel_region(x, group=self.mp.tp_group)
        return x
