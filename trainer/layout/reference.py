"""Each micro-batch's replay reference: the record's route of every router row, found from the
model's own inputs and never from the replay ids, so a fault in the alignment or in a rank's
cut shows as a row whose experts differ from the record's (``replay_followed``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from routereplay.domain.record import MASKED, Record
from trainer.layout.batch import PaddedBatch


def replay_reference(
    batch: PaddedBatch,
    records: Sequence[Record | None],
    layers: Sequence[int],
    local: Callable[[torch.Tensor], torch.Tensor],
) -> dict[int, torch.Tensor]:
    """What each router row should have used under replay, straight from the records.

    Each cell of the batch is named by the model's own inputs: the sample it holds
    (``batch.segments()``) and its position id (``batch.position_ids()``, what the rotary
    embedding reads), token t of sample b. Its expected experts are row t of sample b's record
    (row t: computed with token t as the input). Neither ``align_routes`` nor the replay ids
    are read, so a fault in the alignment or in the cut of a rank's rows shows as a router
    row whose experts differ from the record's.

    Args:
        batch: One micro-batch's tokens as the model reads them.
        records: One per sample of ``batch`` (None: no record); a layer-selected read holds
            ``layers``.
        layers: Global layer numbers of this rank's routers.
        local: This rank's share of a ``[seq, rows, ...]`` tensor, as megatron cuts the
            tokens (``RankShare.megatron_share``).

    Returns:
        Per layer, int64 ``[local tokens, k]`` in megatron's token order; ``MASKED`` rows
        have no recorded route (a sample's final token, padding, no record).
    """
    cells = torch.stack([batch.segments(), batch.position_ids()], dim=-1).transpose(0, 1)
    cells = local(cells.contiguous()).reshape(-1, 2).numpy()
    sample, position = cells[:, 0], cells[:, 1]
    out = {}
    for layer in layers:
        k = next((r.geometry.topk for r in records if r is not None), 1)
        ids = np.full((sample.size, k), MASKED, np.int64)
        for b, record in enumerate(records):
            if record is None:
                continue
            rows = np.flatnonzero((sample == b) & (position < record.num_rows))
            ids[rows] = record.routes[position[rows], record.moe_layers.index(layer)]
        out[layer] = torch.from_numpy(ids)
    return out
