"""A step's micro-batches: which samples go together (fixed size or a token budget, the same
count on every data-parallel rank), and each micro-batch laid out with what the step needs per
token."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from routereplay.domain.record import Record
from trainer.config import TrainConfig
from trainer.data.source import Sample
from trainer.distributed.dp import DataParallel
from trainer.layout.batch import PACKED, PaddedBatch
from trainer.sharding import Parallelism, ParallelismError, dynamic_microbatches, padded_length


@dataclass
class MicroBatch:
    """One micro-batch, padded or packed, with what the step needs per token.

    Attributes:
        samples / records: in micro-batch order (records None where missing).
        index: Each sample's position in the step's batch (results go back there).
        batch: The token layout (``[rows, seq]``: a sample per row, or packed in one row).
        generated: bool ``[rows, seq]``, generated tokens (the loss and gap positions).
        rollout_logp: float32 ``[rows, seq]``, the rollout's log-probs (NaN where none).
        advantages: float32 ``[rows, seq]``, each token its sample's advantage.
    """

    samples: list[Sample]
    records: list[Record | None]
    index: tuple[int, ...]
    batch: PaddedBatch
    generated: torch.Tensor
    rollout_logp: torch.Tensor
    advantages: torch.Tensor

    def per_sample(self, values: torch.Tensor) -> list[torch.Tensor]:
        """A ``[rows, seq, ...]`` tensor cut into each sample's columns."""
        return [self.batch.sample_values(values, b) for b in range(self.batch.batch_size)]


def micro_batches(
    samples: Sequence[Sample],
    records: Sequence[Record | None],
    advantages: np.ndarray,
    size: int,
    padding_side: str,
    multiple: int = 1,
    *,
    groups: Sequence[Sequence[int]] | None = None,
    shape: tuple[int, int] | None = None,
) -> list[MicroBatch]:
    """Split a batch into micro-batches: consecutive runs of ``size`` samples, or the given
    ``groups`` of sample positions (``sharding.dynamic_microbatches``: a token budget).

    Each micro-batch is laid out on its own: padded (``padding_side`` right or left) to its
    longest sample rounded up to a multiple of ``multiple`` (a parallel layout's: sequence
    parallelism splits the sequence over the TP ranks), or ``"packed"``: its samples back to
    back in one row, each padded to that multiple. ``shape`` ``(rows, seq)`` pads every
    micro-batch to one shape (pipeline stages exchange activations of a fixed shape).
    """
    if groups is None:
        groups = [range(lo, min(lo + size, len(samples))) for lo in range(0, len(samples), size)]
    out = []
    for group in groups:
        chunk = [samples[i] for i in group]
        ids, tokens = [s.sample_id for s in chunk], [s.token_ids for s in chunk]
        rows, seq = shape or (None, None)
        if padding_side == PACKED:
            batch = PaddedBatch.packed(ids, tokens, multiple=multiple, max_length=seq)
        else:
            longest = padded_length(max(s.token_ids.size for s in chunk), multiple)
            batch = PaddedBatch.from_samples(
                ids, tokens, padding_side=padding_side, max_length=seq or longest, num_rows=rows
            )
        generated = torch.zeros(batch.token_ids.shape, dtype=torch.bool)
        rollout = torch.full(batch.token_ids.shape, float("nan"))
        adv = torch.zeros(batch.token_ids.shape)
        for b, (i, s) in enumerate(zip(group, chunk, strict=True)):
            batch.sample_values(generated, b)[:] = torch.from_numpy(s.generated)
            batch.sample_values(rollout, b)[:] = torch.from_numpy(s.rollout_logprobs)
            batch.sample_values(adv, b)[:] = float(advantages[i])
        # Column 0 of a sample has no log-prob (nothing before it): never a loss position.
        generated &= batch.position_ids() > 0
        out.append(
            MicroBatch(
                chunk, [records[i] for i in group], tuple(group), batch, generated, rollout, adv
            )
        )
    return out


def step_micro_batches(
    samples: Sequence[Sample],
    records: Sequence[Record | None],
    advantages: np.ndarray,
    train: TrainConfig,
    dp: DataParallel,
    parallelism: Parallelism,
) -> list[list[MicroBatch]]:
    """This rank's mini-batches, each a list of micro-batches (fixed size, or filled up to
    ``train.max_tokens_per_micro_batch`` with the same count on every DP rank).

    Args:
        samples / records / advantages: This DP rank's share of the step's batch.
        train: The step's sizes (mini- and micro-batch, budget, padding or packing).
        dp: The data-parallel group (every rank runs as many mini- and micro-batches).
        parallelism: The parallel sizes (its padding multiple; pipeline stages need one shape).

    Raises:
        ParallelismError: On every rank, when any rank cannot lay its samples out under the budget.
    """
    local_mini = train.mini_batch_size_or_micro // dp.size
    local_micro = max(train.micro_batch_size // dp.size, 1)
    side = PACKED if train.packing else train.padding_side
    multiple = parallelism.multiple
    minis = [
        list(range(lo, min(lo + local_mini, len(samples))))
        for lo in range(0, len(samples), local_mini)
    ]
    minis += [[]] * (int(dp.max(len(minis))) - len(minis))  # a rank short of samples
    groups, error = [], ""
    for mine in minis:
        if train.max_tokens_per_micro_batch is None:
            groups.append([mine[lo : lo + local_micro] for lo in range(0, len(mine), local_micro)])
        else:
            lengths = [samples[j].token_ids.size for j in mine]
            plan, problem = _budget(lengths, train.max_tokens_per_micro_batch, dp, parallelism)
            error = error or problem
            groups.append([[mine[g] for g in group] for group in plan])
    raise_everywhere(error)
    shape = None
    if parallelism.pp > 1:
        # Megatron's pipeline schedules exchange activations of one shape: every
        # micro-batch of the step gets the largest (rows, seq) among them.
        padded = [
            [padded_length(samples[j].token_ids.size, multiple) for j in group]
            for mini in groups
            for group in mini
        ]
        if side == PACKED:
            shape = (1, max((sum(p) for p in padded), default=0))
        else:
            shape = (max(map(len, padded), default=0), max(map(max, padded), default=0))
    return [
        micro_batches(samples, records, advantages, 0, side, multiple, groups=g, shape=shape)
        for g in groups
    ]


def _budget(
    lengths: list[int], budget: int, dp: DataParallel, parallelism: Parallelism
) -> tuple[list[tuple[int, ...]], str]:
    """One mini-batch's micro-batches under the token budget (positions in ``lengths``), as
    many on every DP rank (a multiple of pp under virtual stages: the interleaved schedule runs
    no other counts), and the error that prevents it, if any. Every rank takes part in the
    count's collective, error or not."""
    multiple = parallelism.multiple
    step = parallelism.pp if parallelism.vp is not None else 1
    count, error = 0, ""
    if lengths:
        try:
            count = len(dynamic_microbatches(lengths, budget, multiple=multiple).groups)
        except ParallelismError as exc:
            error = str(exc)
    count = int(dp.max(-(-count // step) * step))
    if not lengths or error:
        return [], error
    try:
        plan = dynamic_microbatches(lengths, budget, multiple=multiple, min_microbatches=count)
    except ParallelismError as exc:
        return [], str(exc)
    return list(plan.groups), ""


def raise_everywhere(error: str) -> None:
    """Raise ``error`` on every rank when any rank has one (no rank left in a collective)."""
    errors = [error]
    if dist.is_initialized() and dist.get_world_size() > 1:
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
    first = next((e for e in errors if e), "")
    if first:
        raise ParallelismError(first)
