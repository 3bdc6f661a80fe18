"""The entry point: one step's fetched samples and records -> this rank's micro-batches and
replay ids (``plan_step``)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from routereplay.domain.record import Geometry, Record
from trainer.config import TrainConfig
from trainer.data.source import Sample
from trainer.distributed.dp import DataParallel
from trainer.layout.align import align_routes
from trainer.layout.microbatch import MicroBatch, step_micro_batches
from trainer.layout.reference import replay_reference
from trainer.layout.share import RankShare


@dataclass(frozen=True)
class StepLayout:
    """This rank's share of one step's batch.

    Attributes:
        minis: This rank's mini-batches, each a list of micro-batches (as many on every DP
            rank; a rank short of samples gets empty ones).
        replay_ids: Per micro-batch (``micro_batches`` order), this rank's replay ids of the
            rollout's routes: one ``[local tokens, k]`` per router of this rank (``replay_dtype``),
            in the routers' order, ``MASKED`` where a row has no recorded route.
        replayed: Per micro-batch, its rows with a recorded route (every rank's rows, one
            layer).
        replayable: Per micro-batch, bool ``[local tokens]``: this rank's rows that have a
            route (a real token followed by one of the same sample), recorded or not.
        reference: Per micro-batch, when asked (``plan_step``'s ``with_reference``; empty
            otherwise), its replay reference: per router layer, int64 ``[local tokens, k]``,
            the record's route of each row, found from the model's inputs and not from
            ``replay_ids`` (``trainer.layout.reference``), ``MASKED`` where there is none.
    """

    minis: list[list[MicroBatch]]
    replay_ids: list[list[torch.Tensor]]
    replayed: list[int]
    replayable: list[torch.Tensor]
    reference: list[dict[int, torch.Tensor]]

    @property
    def micro_batches(self) -> list[MicroBatch]:
        """Every micro-batch of the step, mini-batch after mini-batch."""
        return list(itertools.chain.from_iterable(self.minis))


def plan_step(
    samples: Sequence[Sample],
    records: Sequence[Record | None],
    advantages: np.ndarray,
    *,
    train: TrainConfig,
    dp: DataParallel,
    share: RankShare,
    geometry: Geometry,
    router_layers: Sequence[int],
    model_id: str | None = None,
    with_reference: bool = False,
) -> StepLayout:
    """Lay one step's batch out for this rank: mini- and micro-batches (padded or packed, to
    the layout's multiple), then each micro-batch's records aligned to its token layout, only
    this rank's rows and routers.

    Args:
        samples / records / advantages: This DP rank's share of the step's batch (records None
            where missing: those samples route natively).
        train: The step's sizes. dp: The data-parallel group. share: This rank's rows.
        geometry: The model's routing geometry (records must match it).
        router_layers: Global layer numbers of this rank's routers, ascending.
        model_id: When given, records must carry this model id.
        with_reference: Also find each micro-batch's replay reference (``reference``).

    Raises:
        ParallelismError: On every rank, when any rank cannot lay its samples out.
        InvalidArgument: A record that does not match its sample or the model.
    """
    minis = step_micro_batches(samples, records, advantages, train, dp, share.parallelism)
    ids, replayed, replayable, reference = [], [], [], []
    for mb in itertools.chain.from_iterable(minis):
        aligned = align_routes(
            mb.batch,
            mb.records,
            geometry,
            router_layers,
            missing="native",
            model_id=model_id,
            positions=share.positions(mb.batch),
        )
        ids.append(aligned.indices)
        replayed.append(int(aligned.replayed.sum()))
        replayable.append(share.replayable(mb.batch))
        if with_reference:
            local = share.megatron_share
            reference.append(replay_reference(mb.batch, mb.records, router_layers, local))
    return StepLayout(minis, ids, replayed, replayable, reference)
