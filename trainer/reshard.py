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
stay in ``ROUTE_DTYPE`` (int16, with ``MASKED`` = -1) until ``router_tensors`` turns one
micro-batch into megatron's per-router int64 ``[tokens, k]`` tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from trainer.replay import MASKED

ROUTE_DTYPE = np.int16
"""Host dtype of routes while resharding: holds expert ids < 32768 and ``MASKED``."""


class LayoutError(ValueError):
    """A parallel layout that cannot replay the records as configured (raised before a step)."""


# --------------------------------------------------------------------------------------------
# Layout


@dataclass(frozen=True)
class Layout:
    """Parallel sizes of the trainer (megatron's names).

    Attributes:
        tp: Tensor-parallel size. cp: context-parallel size. pp: pipeline-parallel size.
        vp: Virtual pipeline stages per pipeline rank (None: not interleaved).
        ep: Expert-parallel size (nothing to reshard: expert ids are global).
        etp: Expert tensor-parallel size (None: megatron's default, ``tp``).
        sequence_parallel: Sequence parallel across the TP ranks (megatron requires it for MoE
            training with TP > 1).
    """

    tp: int = 1
    cp: int = 1
    pp: int = 1
    vp: int | None = None
    ep: int = 1
    sequence_parallel: bool = False
    etp: int | None = None

    @property
    def expert_tp(self) -> int:
        return self.tp if self.etp is None else self.etp

    def dp(self, world_size: int) -> int:
        """Data-parallel size for ``world_size`` ranks; refuses a world that does not divide."""
        for name in ("tp", "cp", "pp", "ep"):
            if getattr(self, name) < 1:
                raise LayoutError(f"{name}={getattr(self, name)}; parallel sizes must be >= 1")
        model = self.tp * self.cp * self.pp
        if world_size % model:
            raise LayoutError(
                f"world size {world_size} is not divisible by tp x cp x pp = {self.tp} x "
                f"{self.cp} x {self.pp} = {model}"
            )
        dp = world_size // model
        if (dp * self.cp * self.tp) % (self.ep * self.expert_tp):
            raise LayoutError(
                f"ep x etp = {self.ep} x {self.expert_tp} must divide dp x cp x tp = {dp} x "
                f"{self.cp} x {self.tp} (world size {world_size})"
            )
        if self.tp > 1 and not self.sequence_parallel:
            raise LayoutError("MoE training with tp > 1 needs sequence_parallel=True (megatron)")
        if self.vp is not None and self.pp < 2:
            raise LayoutError(f"vp={self.vp} needs pp > 1")
        return dp

    @property
    def multiple(self) -> int:
        """What each sequence (THD) or the padded sequence length must be a multiple of."""
        return pad_multiple(self.tp, self.cp, self.sequence_parallel)


def pad_multiple(tp: int, cp: int, sequence_parallel: bool) -> int:
    """TP x CP x 2 with context parallelism (2 x CP chunks, each split over TP with SP), TP with
    sequence parallelism alone, else 1."""
    tp_part = tp if sequence_parallel else 1
    return tp_part * cp * 2 if cp > 1 else tp_part


def padded_length(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple``."""
    return -(-length // multiple) * multiple


# --------------------------------------------------------------------------------------------
# 1. Data parallel


def dp_shard(num_samples: int, dp_size: int, dp_rank: int) -> range:
    """Indices of the samples of one DP rank: contiguous blocks, as megatron's sampler hands a
    global batch out (rank r gets ``[r * n / dp, (r + 1) * n / dp)``).

    Raises:
        LayoutError: ``num_samples`` not divisible by ``dp_size`` (ranks would disagree on the
            number of steps and hang).
    """
    if not 0 <= dp_rank < dp_size:
        raise LayoutError(f"dp_rank {dp_rank} outside [0, {dp_size})")
    if num_samples % dp_size:
        raise LayoutError(
            f"a batch of {num_samples} samples does not divide over {dp_size} DP ranks"
        )
    per = num_samples // dp_size
    return range(dp_rank * per, (dp_rank + 1) * per)


# --------------------------------------------------------------------------------------------
# 2. Pipeline stages


@dataclass(frozen=True)
class PipelineSplit:
    """Megatron's decoder-layer split over pipeline (and virtual pipeline) stages.

    The same fields as megatron's ``TransformerConfig``: ``num_layers``,
    ``pipeline_model_parallel_size`` (``pp``), ``virtual_pipeline_model_parallel_size``
    (``vp``), ``num_layers_in_first_pipeline_stage`` / ``..._last_...`` (uneven split),
    ``account_for_embedding_in_pipeline_split`` / ``account_for_loss_in_pipeline_split``.
    A custom ``pipeline_model_parallel_layout`` is not supported (refused by ``from_config``).
    """

    num_layers: int
    pp: int = 1
    vp: int | None = None
    first: int | None = None
    last: int | None = None
    account_for_embedding: bool = False
    account_for_loss: bool = False

    @classmethod
    def from_config(cls, config) -> PipelineSplit:
        """From a megatron ``TransformerConfig`` (or any object with its field names)."""
        if getattr(config, "pipeline_model_parallel_layout", None) is not None:
            raise LayoutError(
                "pipeline_model_parallel_layout (a custom layer layout) is not supported by "
                "router replay resharding; use the uniform or first/last-stage split"
            )
        return cls(
            num_layers=config.num_layers,
            pp=config.pipeline_model_parallel_size,
            vp=config.virtual_pipeline_model_parallel_size,
            first=config.num_layers_in_first_pipeline_stage,
            last=config.num_layers_in_last_pipeline_stage,
            account_for_embedding=bool(config.account_for_embedding_in_pipeline_split),
            account_for_loss=bool(config.account_for_loss_in_pipeline_split),
        )

    def chunk_sizes(self) -> list[list[int]]:
        """``[pp][vp or 1]``: decoder layers built by each (pipeline rank, virtual stage).

        Model chunks run in the order (virtual stage 0: pp ranks 0..pp-1), (virtual stage 1:
        ...), ...; their layers are consecutive global layer numbers in that order.

        Raises:
            LayoutError: A split megatron would refuse or build inconsistently.
        """
        pp, vp = self.pp, self.vp or 1
        if pp < 1 or vp < 1 or self.num_layers < 1:
            raise LayoutError(f"invalid pipeline split {self}")
        if self.vp is not None and pp == 1:
            raise LayoutError("virtual pipeline stages need pp > 1")
        if pp == 1:
            if self.first is not None or self.last is not None:
                raise LayoutError("an uneven first/last stage needs pp > 1")
            return [[self.num_layers]]
        uneven = self.first is not None or self.last is not None
        if uneven:
            if self.account_for_embedding or self.account_for_loss:
                raise LayoutError(
                    "an uneven first/last stage cannot be combined with "
                    "account_for_embedding/loss_in_pipeline_split (megatron refuses it)"
                )
            per_stage = self._uneven_stage_sizes()
        else:
            slots = self.num_layers + self.account_for_embedding + self.account_for_loss
            if slots % pp:
                raise LayoutError(
                    f"{self.num_layers} layers (+{int(self.account_for_embedding)} embedding, "
                    f"+{int(self.account_for_loss)} loss slot) do not divide over pp={pp}"
                )
            per_stage = [slots // pp] * pp
        sizes = []
        for p, n in enumerate(per_stage):
            if n % vp:
                raise LayoutError(
                    f"pipeline stage {p} has {n} layer slots, not divisible by vp={vp}"
                )
            sizes.append([n // vp] * vp)
        if not uneven:
            # The embedding slot is the first chunk's first slot, the loss slot the last's last.
            if self.account_for_embedding:
                sizes[0][0] -= 1
            if self.account_for_loss:
                sizes[pp - 1][vp - 1] -= 1
            if min(min(row) for row in sizes) < 0:
                raise LayoutError("not enough layers for the embedding/loss pipeline slots")
        if sum(map(sum, sizes)) != self.num_layers:
            raise LayoutError(f"pipeline split {self} does not place every layer exactly once")
        return sizes

    def _uneven_stage_sizes(self) -> list[int]:
        pp = self.pp
        fixed = {0: self.first} if self.first is not None else {}
        if self.last is not None:
            fixed[pp - 1] = self.last
        rest = self.num_layers - sum(fixed.values())
        middle = pp - len(fixed)
        if rest < 0 or (middle == 0 and rest != 0) or (middle and rest % middle):
            raise LayoutError(
                f"{self.num_layers} layers with {self.first} on the first and {self.last} on "
                f"the last stage leave {rest} for {middle} middle stages: not an even split"
            )
        if middle == 0 and self.vp is not None:
            # megatron-core 0.16.1's get_transformer_layer_offset divides by the number of
            # middle stages here (ZeroDivisionError): it cannot build this split.
            raise LayoutError(
                "an uneven split with both first and last stages set, virtual stages and no "
                "middle stage is not supported by megatron-core (division by zero)"
            )
        each = rest // middle if middle else 0
        return [fixed.get(p, each) for p in range(pp)]

    def stage_layers(self, pp_rank: int, vp_stage: int | None = None) -> range:
        """Global (0-based) decoder layers built by one pipeline rank (and virtual stage).

        Args:
            pp_rank: Pipeline rank in ``[0, pp)``.
            vp_stage: Virtual stage in ``[0, vp)``; required when ``vp`` is set. When ``vp``
                is None it must be None or 0.
        """
        sizes = self.chunk_sizes()
        vp = self.vp or 1
        if not 0 <= pp_rank < self.pp:
            raise LayoutError(f"pp_rank {pp_rank} outside [0, {self.pp})")
        if vp_stage is None:
            if self.vp is not None:
                raise LayoutError("vp_stage is required with virtual pipeline stages")
            vp_stage = 0
        if not 0 <= vp_stage < vp:
            raise LayoutError(f"vp_stage {vp_stage} outside [0, {vp})")
        # Chunks in execution order: (v, p) for v in vp for p in pp.
        start = sum(sizes[p][v] for v in range(vp_stage) for p in range(self.pp))
        start += sum(sizes[p][vp_stage] for p in range(pp_rank))
        return range(start, start + sizes[pp_rank][vp_stage])


def stage_moe_layers(
    split: PipelineSplit, moe_layers: Sequence[int], pp_rank: int, vp_stage: int | None = None
) -> tuple[int, ...]:
    """The MoE layers (global numbers, ascending) whose routers one stage owns.

    Args:
        split: The model's pipeline split.
        moe_layers: ``Geometry.moe_layers`` of the records (dense layers already excluded).
        pp_rank, vp_stage: The stage.

    Raises:
        LayoutError: ``check_split`` fails.
    """
    check_split(split, moe_layers)
    owned = split.stage_layers(pp_rank, vp_stage)
    return tuple(layer for layer in moe_layers if layer in owned)


def check_split(split: PipelineSplit, moe_layers: Sequence[int]) -> None:
    """Refuse a pipeline split that disagrees with the record geometry: MoE layer numbers
    beyond the model's layers, or a split that does not place every layer exactly once.

    Raises:
        LayoutError: naming both sides.
    """
    sizes = split.chunk_sizes()
    if not moe_layers:
        raise LayoutError("the record geometry has no MoE layers")
    if max(moe_layers) >= split.num_layers or min(moe_layers) < 0:
        raise LayoutError(
            f"the records route layers {list(moe_layers)}, but the pipeline split covers "
            f"layers 0..{split.num_layers - 1} ({split.num_layers} layers): the records come "
            "from another model or the split's num_layers is wrong"
        )
    assert sum(map(sum, sizes)) == split.num_layers


def check_stage_routers(expected: Sequence[int], built: Sequence[int], where: str = "") -> None:
    """Refuse a built stage whose routers' layer numbers differ from the split's share."""
    if tuple(expected) != tuple(built):
        raise LayoutError(
            f"{where}the stage built routers on layers {list(built)}; the pipeline split and "
            f"the record geometry give it {list(expected)}"
        )


def layer_columns(moe_layers: Sequence[int], layers: Sequence[int]) -> list[int]:
    """Record columns of ``layers`` (global numbers) in ``moe_layers`` (the record's order)."""
    index = {layer: j for j, layer in enumerate(moe_layers)}
    missing = [layer for layer in layers if layer not in index]
    if missing:
        raise LayoutError(f"layers {missing} are not MoE layers of the records {list(moe_layers)}")
    return [index[layer] for layer in layers]


# --------------------------------------------------------------------------------------------
# 3. Micro-batches and dynamic batching


def split_padded_microbatches(x: torch.Tensor, seq: int, num_microbatches: int) -> list:
    """Split a padded batch's rows (megatron order ``[seq * batch, ...]``) into micro-batches
    of consecutive samples: micro-batch m holds samples ``[m * b / M, (m + 1) * b / M)``, each
    returned in megatron order ``[seq * (b / M), ...]``."""
    batch = x.shape[0] // seq
    if seq * batch != x.shape[0]:
        raise LayoutError(f"{x.shape[0]} rows are not seq={seq} x a batch size")
    if batch % num_microbatches:
        raise LayoutError(
            f"a batch of {batch} does not split into {num_microbatches} micro-batches"
        )
    per = batch // num_microbatches
    view = x.reshape(seq, batch, *x.shape[1:])
    return [
        view[:, m * per : (m + 1) * per].reshape(seq * per, *x.shape[1:])
        for m in range(num_microbatches)
    ]


@dataclass(frozen=True)
class DynamicBatches:
    """Samples grouped into micro-batches under a token budget.

    Attributes:
        groups: Per micro-batch, the original indices of its samples (execution order).
        tokens: Per micro-batch, its token count (after padding to ``multiple``).
    """

    groups: tuple[tuple[int, ...], ...]
    tokens: tuple[int, ...]

    @property
    def order(self) -> np.ndarray:
        """int64 ``[n]``: original sample index at each position of the execution order."""
        return np.fromiter((i for g in self.groups for i in g), dtype=np.int64)

    @property
    def inverse(self) -> np.ndarray:
        """int64 ``[n]``: execution position of each original sample (``order``'s inverse)."""
        order = self.order
        inv = np.empty_like(order)
        inv[order] = np.arange(order.size)
        return inv

    def restore(self, results: Sequence) -> list:
        """Per-sample results given in execution order -> the original sample order."""
        if len(results) != self.order.size:
            raise ValueError(f"{len(results)} results for {self.order.size} samples")
        return [results[p] for p in self.inverse]


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
        multiple: Each sample is padded to this multiple when packed (``Layout.multiple``).
        min_microbatches: At least this many micro-batches (empty ones are refused).

    Raises:
        LayoutError: A single sample over the budget, or more micro-batches than samples.
    """
    sizes = [padded_length(int(n), multiple) for n in lengths]
    if not sizes:
        raise LayoutError("no samples to batch")
    if max(sizes) > max_tokens:
        raise LayoutError(
            f"a sample of {max(sizes)} tokens (padded to a multiple of {multiple}) exceeds the "
            f"micro-batch budget of {max_tokens} tokens"
        )
    count = max(min_microbatches, math.ceil(sum(sizes) / max_tokens))
    by_size = sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))
    while True:
        if count > len(sizes):
            raise LayoutError(f"{count} micro-batches for {len(sizes)} samples")
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


# --------------------------------------------------------------------------------------------
# 4. Packing (THD)


@dataclass(frozen=True)
class PackPlan:
    """Where each sequence sits in a packed (THD) micro-batch.

    Attributes:
        lengths: int64 ``[n]`` real tokens per sequence.
        cu_seqlens: int64 ``[n + 1]`` cumulative real lengths (megatron's ``cu_seqlens``).
        cu_seqlens_padded: int64 ``[n + 1]`` cumulative padded lengths; sequence i occupies
            packed rows ``[cu_seqlens_padded[i], cu_seqlens_padded[i + 1])``, its real tokens
            first.
    """

    lengths: np.ndarray
    cu_seqlens: np.ndarray
    cu_seqlens_padded: np.ndarray

    @classmethod
    def build(cls, lengths: Sequence[int], multiple: int = 1) -> PackPlan:
        lengths = np.asarray(lengths, dtype=np.int64)
        if lengths.ndim != 1 or lengths.size == 0 or (lengths < 1).any():
            raise LayoutError(f"sequence lengths must be positive, got {lengths.tolist()}")
        padded = -(-lengths // multiple) * multiple
        zero = np.zeros(1, np.int64)
        return cls(
            lengths,
            np.concatenate([zero, lengths.cumsum()]),
            np.concatenate([zero, padded.cumsum()]),
        )

    @property
    def total(self) -> int:
        """Packed rows, padding included."""
        return int(self.cu_seqlens_padded[-1])

    @property
    def padded_lengths(self) -> np.ndarray:
        return np.diff(self.cu_seqlens_padded)

    @property
    def max_seqlen(self) -> int:
        return int(self.padded_lengths.max())

    def valid(self) -> np.ndarray:
        """bool ``[total]``: True on real tokens."""
        out = np.zeros(self.total, dtype=bool)
        for start, n in zip(self.cu_seqlens_padded[:-1], self.lengths, strict=True):
            out[start : start + n] = True
        return out

    def position_ids(self) -> np.ndarray:
        """int64 ``[total]``: 0 at each sequence's first token, counting on through its
        padding (what megatron's THD batches carry)."""
        starts = np.repeat(self.cu_seqlens_padded[:-1], self.padded_lengths)
        return np.arange(self.total, dtype=np.int64) - starts


def pack_rows(rows: Sequence[np.ndarray], plan: PackPlan, fill) -> np.ndarray:
    """Concatenate per-sequence arrays along axis 0 at the plan's padded offsets.

    Args:
        rows: Per sequence ``[r_i, ...]`` with ``r_i <= lengths[i]`` (tokens: ``r_i = T_i``;
            a record's routes: ``r_i = T_i - 1``, so the final token stays ``fill``).
        plan: The packing plan.
        fill: Value of every row not given (padding, the final tokens' routes).

    Returns:
        ``[plan.total, ...]`` with ``rows``' trailing shape and dtype.
    """
    if len(rows) != plan.lengths.size:
        raise LayoutError(f"{len(rows)} sequences for a plan of {plan.lengths.size}")
    first = np.asarray(rows[0])
    out = np.full((plan.total, *first.shape[1:]), fill, dtype=first.dtype)
    for i, r in enumerate(rows):
        if r.shape[0] > plan.lengths[i] or r.shape[1:] != first.shape[1:]:
            raise LayoutError(
                f"sequence {i}: {tuple(r.shape)} rows for {int(plan.lengths[i])} tokens"
            )
        start = int(plan.cu_seqlens_padded[i])
        out[start : start + r.shape[0]] = r
    return out


def pack_routes(
    routes: Sequence[np.ndarray], plan: PackPlan, columns: Sequence[int] | None = None
) -> np.ndarray:
    """Pack records' routes exactly as their tokens: ``ROUTE_DTYPE`` ``[plan.total, L', k]``.

    Args:
        routes: Per sequence a record's ``[T_i - 1, L, k]`` (uint8 / uint16).
        plan: Built from the sequences' token counts ``T_i``.
        columns: Record columns to keep (this stage's layers); all when None.

    Row ``cu_seqlens_padded[i] + j`` is token j of sequence i; each final token and all padding
    are ``MASKED``.
    """
    for i, r in enumerate(routes):
        if r.shape[0] != plan.lengths[i] - 1:
            raise LayoutError(
                f"sequence {i}: {r.shape[0]} route rows for {int(plan.lengths[i])} tokens "
                "(a record has one row per token but the last)"
            )
    sel = [r if columns is None else r[:, columns] for r in routes]
    return pack_rows([r.astype(ROUTE_DTYPE, copy=False) for r in sel], plan, MASKED)


def unpack_rows(packed: np.ndarray, plan: PackPlan, rows: Sequence[int] | None = None) -> list:
    """Inverse of ``pack_rows``: per sequence its first ``rows[i]`` (default: all real) rows."""
    rows = plan.lengths if rows is None else rows
    return [
        packed[int(s) : int(s) + int(n)]
        for s, n in zip(plan.cu_seqlens_padded[:-1], rows, strict=True)
    ]


# --------------------------------------------------------------------------------------------
# 5. Context parallel


def cp_index(seq_len: int, cp_size: int, cp_rank: int) -> np.ndarray:
    """int64 ``[seq_len / cp_size]``: the positions one CP rank keeps of a sequence.

    The sequence is cut into ``2 * cp_size`` equal chunks; rank r keeps chunk r, then chunk
    ``2 * cp_size - 1 - r`` (causal attention's load balance).

    Raises:
        LayoutError: ``seq_len`` not a multiple of ``2 * cp_size``.
    """
    if not 0 <= cp_rank < cp_size:
        raise LayoutError(f"cp_rank {cp_rank} outside [0, {cp_size})")
    if cp_size == 1:
        return np.arange(seq_len, dtype=np.int64)
    chunks = 2 * cp_size
    if seq_len % chunks:
        raise LayoutError(
            f"a sequence of {seq_len} tokens does not split into 2 x cp = {chunks} chunks; pad "
            "it to a multiple of tp x cp x 2"
        )
    c = seq_len // chunks
    first = np.arange(cp_rank * c, (cp_rank + 1) * c)
    second = np.arange((chunks - 1 - cp_rank) * c, (chunks - cp_rank) * c)
    return np.concatenate([first, second]).astype(np.int64)


def cp_packed_index(plan: PackPlan, cp_size: int, cp_rank: int) -> np.ndarray:
    """int64: the packed rows one CP rank keeps, sequence by sequence (``cp_index`` applied to
    each padded sequence), in packed order."""
    parts = [
        int(start) + cp_index(int(n), cp_size, cp_rank)
        for start, n in zip(plan.cu_seqlens_padded[:-1], plan.padded_lengths, strict=True)
    ]
    return np.concatenate(parts)


def cp_local_plan(plan: PackPlan, cp_size: int) -> np.ndarray:
    """int64 ``[n + 1]``: cumulative padded lengths of the CP-local packed sequence (each
    sequence keeps ``padded / cp`` rows on every CP rank)."""
    return plan.cu_seqlens_padded // cp_size


# --------------------------------------------------------------------------------------------
# 6. Sequence parallel


def sp_slice(num_rows: int, tp_size: int, tp_rank: int) -> slice:
    """This TP rank's contiguous rows of a sequence-parallel region of ``num_rows`` rows
    (megatron's scatter along the first dimension of ``[seq, batch, hidden]``, i.e. of the
    flattened ``[seq * batch]`` token rows)."""
    if not 0 <= tp_rank < tp_size:
        raise LayoutError(f"tp_rank {tp_rank} outside [0, {tp_size})")
    if num_rows % tp_size:
        raise LayoutError(
            f"{num_rows} rows do not split over {tp_size} sequence-parallel ranks; pad the "
            "sequence to a multiple of tp"
        )
    per = num_rows // tp_size
    return slice(tp_rank * per, (tp_rank + 1) * per)


# --------------------------------------------------------------------------------------------
# The whole share of one rank


@dataclass(frozen=True)
class RankCoords:
    """One rank's coordinates in the layout (megatron's ranks within each group)."""

    tp_rank: int = 0
    cp_rank: int = 0
    pp_rank: int = 0
    vp_stage: int | None = None


def shard_packed(packed: np.ndarray, plan: PackPlan, layout: Layout, coords: RankCoords):
    """One packed micro-batch ``[plan.total, ...]`` -> this rank's rows: CP chunks per
    sequence, then this TP rank's sequence-parallel share of the CP-local rows.

    Works for routes (``pack_routes``), token ids and position ids alike.
    """
    if layout.multiple > 1 and (plan.padded_lengths % layout.multiple).any():
        raise LayoutError(
            f"packed sequences must be padded to a multiple of {layout.multiple} for {layout}"
        )
    local = packed
    if layout.cp > 1:
        local = packed[cp_packed_index(plan, layout.cp, coords.cp_rank)]
    if layout.sequence_parallel and layout.tp > 1:
        local = local[sp_slice(local.shape[0], layout.tp, coords.tp_rank)]
    return local


def shard_padded(x, seq: int, layout: Layout, coords: RankCoords):
    """A padded batch's rows in megatron order ``[seq * batch, ...]`` -> this rank's rows:
    CP chunks along ``seq``, then the SP share of the CP-local ``[seq / cp * batch]`` rows
    (megatron scatters ``[seq, batch, hidden]`` along seq, so rows stay seq-major)."""
    batch = x.shape[0] // seq
    if seq * batch != x.shape[0]:
        raise LayoutError(f"{x.shape[0]} rows are not seq={seq} x a batch size")
    if seq % layout.multiple:
        raise LayoutError(f"seq={seq} must be a multiple of {layout.multiple} for {layout}")
    local = x
    if layout.cp > 1:
        view = x.reshape(seq, batch, *x.shape[1:])
        idx = cp_index(seq, layout.cp, coords.cp_rank)
        local = view[torch.from_numpy(idx) if isinstance(x, torch.Tensor) else idx]
        local = local.reshape(-1, *x.shape[1:])
    if layout.sequence_parallel and layout.tp > 1:
        local = local[sp_slice(local.shape[0], layout.tp, coords.tp_rank)]
    return local


def router_tensors(local: np.ndarray | torch.Tensor) -> list[torch.Tensor]:
    """``[tokens, L', k]`` routes of this rank -> megatron's per-router int64 ``[tokens, k]``
    tensors (``RouterReplayControl.load``), in column order."""
    t = torch.as_tensor(local)
    return [t[:, j].to(torch.int64).contiguous() for j in range(t.shape[1])]


def reshard_packed_routes(
    routes: Sequence[np.ndarray],
    lengths: Sequence[int],
    moe_layers: Sequence[int],
    split: PipelineSplit,
    layout: Layout,
    coords: RankCoords,
) -> tuple[np.ndarray, PackPlan, tuple[int, ...]]:
    """One packed micro-batch's routes for one rank: this stage's layers, packed, CP, SP.

    Args:
        routes: Per sequence the record's ``[T_i - 1, L, k]`` routes (this micro-batch's
            sequences, in their packed order).
        lengths: ``T_i`` per sequence.
        moe_layers: The records' ``Geometry.moe_layers``.
        split: The model's pipeline split.
        layout: The parallel layout; coords: this rank.

    Returns:
        ``(local, plan, layers)``: ``ROUTE_DTYPE`` ``[local_tokens, len(layers), k]``, the
        packing plan of the whole micro-batch, and the stage's MoE layers.
    """
    layers = stage_moe_layers(split, moe_layers, coords.pp_rank, coords.vp_stage)
    columns = layer_columns(moe_layers, layers)
    plan = PackPlan.build(lengths, layout.multiple)
    for i, r in enumerate(routes):
        if r.shape[0] != plan.lengths[i] - 1:
            raise LayoutError(
                f"sequence {i}: {r.shape[0]} route rows for {int(plan.lengths[i])} tokens"
            )
    # The packed rows this rank keeps (CP chunks, then its SP share), gathered straight from
    # each record: the same rows as shard_packed(pack_routes(...)) without packing the rest.
    rows = local_packed_rows(plan, layout, coords)
    k = routes[0].shape[2] if routes else 0
    out = np.empty((rows.size, len(layers), k), dtype=ROUTE_DTYPE)
    if not layers:
        return out, plan, layers
    seq = np.searchsorted(plan.cu_seqlens_padded, rows, side="right") - 1
    offset = rows - plan.cu_seqlens_padded[seq]
    # A stage's layers are usually consecutive record columns: a slice is a view, no copy.
    if list(columns) == list(range(columns[0], columns[-1] + 1)):
        cols = slice(columns[0], columns[-1] + 1)
    else:
        cols = np.asarray(columns)
    bounds = np.searchsorted(seq, np.arange(plan.lengths.size + 1))  # rows are seq-sorted
    for i, r in enumerate(routes):
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        if lo == hi:
            continue  # none of this sequence's rows are on this rank
        off = offset[lo:hi]
        # This rank's rows of one sequence form a few runs of consecutive offsets (one per CP
        # chunk, cut by the SP share): copy each run's recorded prefix as a block; the rest
        # (the final token, padding) is MASKED.
        starts = np.concatenate([[0], np.flatnonzero(np.diff(off) != 1) + 1, [hi - lo]])
        for a, b in zip(starts[:-1], starts[1:], strict=True):
            first = int(off[a])
            n = max(0, min(int(b - a), r.shape[0] - first))
            if n:
                out[lo + a : lo + a + n] = r[first : first + n, cols]
            out[lo + a + n : lo + b] = MASKED
    return out, plan, layers


def local_packed_rows(plan: PackPlan, layout: Layout, coords: RankCoords) -> np.ndarray:
    """int64: the packed rows (``[0, plan.total)``) one rank keeps, in its local order."""
    rows = np.arange(plan.total, dtype=np.int64)
    return np.asarray(shard_packed(rows, plan, layout, coords))
