"""R2: the trainer records its own routes in the old-logprob pass, then replays them.

The old-logprob pass runs each micro-batch once with natural routing under megatron's
``RECORD`` action (which keeps only the last forward, so the routes are collected per
micro-batch) and turns them into records of the rollout's layout-free form. The PPO update
passes over that batch then align and replay those records exactly as R3 replays the
rollout's, so they keep the recorded routes even after optimizer steps moved the router.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from routereplay.record import Record, Turn
from trainer.align import routes_from_recorded
from trainer.batch import PaddedBatch
from trainer.model import TrainerModel


def record_pass(
    built: TrainerModel,
    micro_batches: Sequence[PaddedBatch],
    forward: Callable[[torch.nn.Module, PaddedBatch], Any],
) -> tuple[list[Any], list[Record]]:
    """Run the old-logprob pass and record every sample's routes.

    Args:
        built: The model, built with ``routing_replay=True``.
        micro_batches: The batch, split into micro-batches.
        forward: ``forward(model, micro_batch)`` returning what the caller keeps (old
            log-probs); it runs without gradients.

    Returns:
        ``(outputs, records)``: ``forward``'s result per micro-batch, and one record per sample
        (in micro-batch order) whose ``routes`` ``[T - 1, L, k]`` are what this model chose.
    """
    if built.replay is None:
        raise ValueError("R2 needs a model built with routing_replay=True")
    outputs, records = [], []
    for batch in micro_batches:
        recorded: list[list[torch.Tensor]] = []
        with torch.no_grad(), built.replay.step(), built.replay.recording(recorded):
            outputs.append(forward(built.model, batch))
        routes = routes_from_recorded(batch, recorded[0], built.geometry)
        for b, sample_routes in enumerate(routes):
            tokens = batch.sample_tokens(b).numpy().astype(np.int32)
            # Which tokens were generated is the rollout's knowledge, not the trainer's.
            turn = Turn(token_start=0, token_end=tokens.size, generated_start=tokens.size)
            records.append(
                Record(batch.sample_ids[b], built.geometry, tokens, sample_routes, [turn])
            )
    return outputs, records
