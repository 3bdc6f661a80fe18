"""Each trainer rank's share of a batch, as pure functions (architecture.md, trainer steps 3-7).

Routes in the cache are layout-free (``Record.routes``: ``[T - 1, L, k]``, row i = token i as
the input, one column per MoE layer). A trainer rank replays exactly the routes of the tokens
and layers it computes; these functions derive that share with the same transformations the
tokens go through, in this order:

1. **Samples of this data-parallel rank** (``dp_shard``): each DP rank fetches and aligns only
   its own samples.
2. **Layers of this pipeline stage** (``stage_layers`` / ``stage_moe_layers``): megatron's
   layer split, re-derived here and checked against megatron's own functions in the tests;
   each stage's routers replay only their layers' record columns.
3. **Micro-batches** (``dynamic_microbatches`` by token budget; a padded batch is cut along its
   samples).
   A packed micro-batch is packed on its own, so micro-batch assignment comes before packing.
4. **Packing** (``PackPlan``): a micro-batch's sequences back to back in one row, each padded
   to the multiple the parallel sizes need (``pad_multiple``: TP x CP x 2 with CP, TP with SP); a
   padded ``[batch, seq]`` batch pads ``seq`` to the same multiple instead.
5. **Context parallel** (``cp_index``): 2 x CP chunks of the sequence; rank r keeps chunks r
   and 2 x CP - 1 - r.
6. **Sequence parallel** (``sp_slice``): this TP rank's contiguous share of the (CP-local)
   sequence dimension, in megatron's ``[seq, batch]`` token order. ``shard_padded`` applies
   5 and 6 to a micro-batch's rows (replay ids, masks).

Everything here is torch / numpy on the host; nothing touches a process group, nothing imports
megatron or the rest of the trainer. ``trainer.layout`` runs these steps for the RL step.

Modules, by concern: ``parallel`` (the parallel sizes, a rank's coordinates, step 1),
``layers`` (layer ownership, step 2), ``batching`` (step 3), ``packing`` (steps 4-6: the
packing plan, the CP and SP cuts of one sequence), ``rows`` (a micro-batch's rows cut to one
rank). Everything is
importable from ``trainer.sharding``.
"""

from __future__ import annotations

from trainer.sharding.batching import (
    DynamicBatches,
    dynamic_microbatches,
)
from trainer.sharding.layers import (
    PipelineSplit,
    check_split,
    check_stage_routers,
    layer_columns,
    stage_moe_layers,
)
from trainer.sharding.packing import PackPlan, cp_index, sp_slice
from trainer.sharding.parallel import (
    Parallelism,
    ParallelismError,
    RankCoords,
    dp_shard,
    pad_multiple,
    padded_length,
)
from trainer.sharding.rows import rank_positions, shard_padded

__all__ = [
    "DynamicBatches",
    "Parallelism",
    "ParallelismError",
    "PackPlan",
    "PipelineSplit",
    "RankCoords",
    "check_split",
    "check_stage_routers",
    "cp_index",
    "dp_shard",
    "dynamic_microbatches",
    "layer_columns",
    "pad_multiple",
    "padded_length",
    "rank_positions",
    "shard_padded",
    "sp_slice",
    "stage_moe_layers",
]
