"""Micro-batches (step 3): dynamic batching of samples under a token budget."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from trainer.sharding.parallel import ParallelismError, padded_length


@dataclass(frozen=True)
class DynamicBatches:
    """Samples grouped into micro-batches under a token budget.

    Attributes:
        groups: Per micro-batch, the original indices of its samples (execution order).
        tokens: Per micro-batch, its token count (after padding to ``multiple``).
    """

    groups: tuple[tuple[int, ...], ...]
    tokens: tuple[int, ...]


def dynamic_microbatches(
    lengths: Sequence[int],
    max_tokens: int,
    *,
    multiple: int = 1,
    min_microbatches: int = 1,
) -> DynamicBatches:
    """Group samples into micro-batches of at most ``max_tokens`` (padded) tokens, balanced.

    Longest first, each sample goes to the micro-batch with the fewest tokens that still has
    room; the count starts at the lower bound ``ceil(total / max_tokens)`` (or
    ``min_microbatches``, e.g. the maximum over DP ranks so every rank runs the same number)
    and grows until everything fits. Micro-batches run heaviest first; within one, samples keep
    their original relative order.

    Args:
        lengths: Tokens per sample.
        max_tokens: Budget per micro-batch.
        multiple: Each sample is padded to this multiple when packed (``Parallelism.multiple``).
        min_microbatches: At least this many micro-batches (empty ones are refused).

    Raises:
        ParallelismError: A single sample over the budget, or more micro-batches than samples.
    """
    sizes = [padded_length(int(n), multiple) for n in lengths]
    if not sizes:
        raise ParallelismError("no samples to batch")
    if max(sizes) > max_tokens:
        raise ParallelismError(
            f"a sample of {max(sizes)} tokens (padded to a multiple of {multiple}) exceeds the "
            f"micro-batch budget of {max_tokens} tokens"
        )
    count = max(min_microbatches, math.ceil(sum(sizes) / max_tokens))
    by_size = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    while True:
        if count > len(sizes):
            raise ParallelismError(f"{count} micro-batches for {len(sizes)} samples")
        loads, groups = [0] * count, [[] for _ in range(count)]
        fits = True
        for i in by_size:
            room = [m for m in range(count) if loads[m] + sizes[i] <= max_tokens]
            if not room:
                fits = False
                break
            m = min(room, key=lambda m: (loads[m], m))
            loads[m] += sizes[i]
            groups[m].append(i)
        if fits and all(groups):
            break
        count += 1
    ranked = sorted(range(count), key=lambda m: (-loads[m], min(groups[m])))
    return DynamicBatches(
        tuple(tuple(sorted(groups[m])) for m in ranked), tuple(loads[m] for m in ranked)
    )
