"""Each trainer rank's share of the routes, as pure functions (architecture.md, trainer steps 3-7).

Routes in the cache are layout-free (``Record.routes``: ``[T - 1, L, k]``, row i = token i as
the input, one column per MoE layer). A trainer rank replays exactly the routes of the tokens
and layers it computes; these functions derive that share with the same transformations the
tokens go through, in this order:

1. **Samples of this data-parallel rank** (``dp_shard``): each DP rank fetches and aligns only
   its own samples.
2. **Layers of this pipeline stage** (``stage_layers`` / ``stage_moe_layers``): megatron's
   layer split, re-derived here and checked against megatron's own functions in the tests;
   routes keep only the columns of this stage's (and virtual stage's) routers.
3. **Micro-batches** (``dynamic_microbatches`` by token budget, with the permutation that puts
   results back in the original order; ``split_padded_microbatches`` for a padded batch).
   With packed sequences a micro-batch is packed on its own, so micro-batch assignment comes
   before packing.
4. **Packing** (THD, ``PackPlan`` / ``pack_rows``): sequences concatenated, each padded to the
   multiple the layout needs (``pad_multiple``: TP x CP x 2 with CP, TP with SP); routes are
   packed exactly as the tokens, ``MASKED`` on each sequence's final token and its padding.
   A padded ``[batch, seq]`` layout pads ``seq`` to the same multiple instead.
5. **Context parallel** (``cp_index`` / ``cp_packed_index``): 2 x CP chunks per sequence; rank
   r keeps chunks r and 2 x CP - 1 - r.
6. **Sequence parallel** (``sp_slice``): this TP rank's contiguous share of the (CP-local)
   sequence dimension, in megatron's ``[seq, batch]`` token order.

Everything here is torch / numpy on the host; nothing touches a process group. Route tensors
stay in ``ROUTE_DTYPE`` (int32, with ``MASKED`` = -1) until ``router_tensors`` turns one
micro-batch into megatron's per-router int64 ``[tokens, k]`` tensors.

Modules, by concern: ``layout`` (the layout, a rank's coordinates, step 1), ``layers`` (layer
ownership, step 2), ``microbatch`` (step 3), ``packing`` (steps 4-6), ``share`` (one rank's
whole share, step 7). Everything is importable from ``trainer.reshard``.
"""

from __future__ import annotations

from trainer.reshard.layers import (
    PipelineSplit,
    check_split,
    check_stage_routers,
    layer_columns,
    stage_moe_layers,
)
from trainer.reshard.layout import (
    ROUTE_DTYPE,
    Layout,
    LayoutError,
    RankCoords,
    dp_shard,
    pad_multiple,
    padded_length,
)
from trainer.reshard.microbatch import (
    DynamicBatches,
    dynamic_microbatches,
    split_padded_microbatches,
)
from trainer.reshard.packing import (
    PackPlan,
    cp_index,
    cp_local_plan,
    cp_packed_index,
    pack_routes,
    pack_rows,
    sp_slice,
    unpack_rows,
)
from trainer.reshard.share import (
    local_packed_rows,
    reshard_packed_routes,
    router_tensors,
    shard_packed,
    shard_padded,
)

__all__ = [
    "DynamicBatches",
    "Layout",
    "LayoutError",
    "PackPlan",
    "PipelineSplit",
    "ROUTE_DTYPE",
    "RankCoords",
    "check_split",
    "check_stage_routers",
    "cp_index",
    "cp_local_plan",
    "cp_packed_index",
    "dp_shard",
    "dynamic_microbatches",
    "layer_columns",
    "local_packed_rows",
    "pack_routes",
    "pack_rows",
    "pad_multiple",
    "padded_length",
    "reshard_packed_routes",
    "router_tensors",
    "shard_packed",
    "shard_padded",
    "sp_slice",
    "split_padded_microbatches",
    "stage_moe_layers",
    "unpack_rows",
]
