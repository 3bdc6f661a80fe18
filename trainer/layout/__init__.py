"""The step's layout: fetched samples and records -> this rank's micro-batches and replay ids.

One entry point, ``plan_step`` (``plan.py``), returns a ``StepLayout``: this rank's
mini-batches of micro-batches and, per micro-batch, its replay ids per router, the rows with a
recorded route, the rows that could have one and, when asked (R3), its replay reference. On
the way:

1. ``microbatch``: mini-batches, then micro-batches of a fixed size or under a token budget
   (the same count on every data-parallel rank; one shape under pipeline stages);
2. ``batch``: each micro-batch's token layout, ``PaddedBatch`` (padded right or left, or packed
   in one row with a block-diagonal mask), to the parallel sizes' multiple;
3. ``align``: records -> per-router replay ids in megatron's token order, checked against the
   model and the tokens;
4. ``share``: this rank's rows of them (context-parallel chunks, sequence-parallel split);
5. ``reference``: the record's route of every router row, found from the model's inputs and
   not from the replay ids (``replay_followed``'s reference).

The pure layout functions it uses (the parallel sizes, layer split, token-budget grouping, CP
and SP cuts) are in ``trainer.sharding``, which knows nothing of megatron or the step.
"""

from __future__ import annotations

from trainer.layout.microbatch import MicroBatch, micro_batches
from trainer.layout.plan import StepLayout, plan_step
from trainer.layout.share import RankShare

__all__ = ["MicroBatch", "RankShare", "StepLayout", "micro_batches", "plan_step"]
