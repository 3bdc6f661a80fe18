"""Layer ownership (step 2): megatron's decoder-layer split over pipeline and virtual pipeline
stages, re-derived, and the record columns of a stage's routers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trainer.sharding.parallel import ParallelismError


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
            raise ParallelismError(
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
            ParallelismError: A split megatron would refuse or build inconsistently.
        """
        pp, vp = self.pp, self.vp or 1
        if pp < 1 or vp < 1 or self.num_layers < 1:
            raise ParallelismError(f"invalid pipeline split {self}")
        if self.vp is not None and pp == 1:
            raise ParallelismError("virtual pipeline stages need pp > 1")
        if pp == 1:
            if self.first is not None or self.last is not None:
                raise ParallelismError("an uneven first/last stage needs pp > 1")
            return [[self.num_layers]]
        uneven = self.first is not None or self.last is not None
        if uneven:
            if self.account_for_embedding or self.account_for_loss:
                raise ParallelismError(
                    "an uneven first/last stage cannot be combined with "
                    "account_for_embedding/loss_in_pipeline_split (megatron refuses it)"
                )
            per_stage = self._uneven_stage_sizes()
        else:
            slots = self.num_layers + self.account_for_embedding + self.account_for_loss
            if slots % pp:
                raise ParallelismError(
                    f"{self.num_layers} layers (+{int(self.account_for_embedding)} embedding, "
                    f"+{int(self.account_for_loss)} loss slot) do not divide over pp={pp}"
                )
            per_stage = [slots // pp] * pp
        sizes = []
        for p, n in enumerate(per_stage):
            if n % vp:
                raise ParallelismError(
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
                raise ParallelismError("not enough layers for the embedding/loss pipeline slots")
        if sum(map(sum, sizes)) != self.num_layers:
            raise ParallelismError(f"pipeline split {self} does not place every layer exactly once")
        return sizes

    def _uneven_stage_sizes(self) -> list[int]:
        pp = self.pp
        fixed = {0: self.first} if self.first is not None else {}
        if self.last is not None:
            fixed[pp - 1] = self.last
        rest = self.num_layers - sum(fixed.values())
        middle = pp - len(fixed)
        if rest < 0 or (middle == 0 and rest != 0) or (middle and rest % middle):
            raise ParallelismError(
                f"{self.num_layers} layers with {self.first} on the first and {self.last} on "
                f"the last stage leave {rest} for {middle} middle stages: not an even split"
            )
        if middle == 0 and self.vp is not None:
            # megatron-core 0.16.1's get_transformer_layer_offset divides by the number of
            # middle stages here (ZeroDivisionError): it cannot build this split.
            raise ParallelismError(
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
            raise ParallelismError(f"pp_rank {pp_rank} outside [0, {self.pp})")
        if vp_stage is None:
            if self.vp is not None:
                raise ParallelismError("vp_stage is required with virtual pipeline stages")
            vp_stage = 0
        if not 0 <= vp_stage < vp:
            raise ParallelismError(f"vp_stage {vp_stage} outside [0, {vp})")
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
        ParallelismError: ``check_split`` fails.
    """
    check_split(split, moe_layers)
    owned = split.stage_layers(pp_rank, vp_stage)
    return tuple(layer for layer in moe_layers if layer in owned)


def check_split(split: PipelineSplit, moe_layers: Sequence[int]) -> None:
    """Refuse a pipeline split that disagrees with the record geometry: MoE layer numbers
    beyond the model's layers, or a split that does not place every layer exactly once.

    Raises:
        ParallelismError: naming both sides.
    """
    sizes = split.chunk_sizes()
    if not moe_layers:
        raise ParallelismError("the record geometry has no MoE layers")
    if max(moe_layers) >= split.num_layers or min(moe_layers) < 0:
        raise ParallelismError(
            f"the records route layers {list(moe_layers)}, but the pipeline split covers "
            f"layers 0..{split.num_layers - 1} ({split.num_layers} layers): the records come "
            "from another model or the split's num_layers is wrong"
        )
    assert sum(map(sum, sizes)) == split.num_layers


def check_stage_routers(expected: Sequence[int], built: Sequence[int], where: str = "") -> None:
    """Refuse a built stage whose routers' layer numbers differ from the split's share."""
    if tuple(expected) != tuple(built):
        raise ParallelismError(
            f"{where}the stage built routers on layers {list(built)}; the pipeline split and "
            f"the record geometry give it {list(expected)}"
        )


def layer_columns(moe_layers: Sequence[int], layers: Sequence[int]) -> list[int]:
    """Record columns of ``layers`` (global numbers) in ``moe_layers`` (the record's order)."""
    index = {layer: j for j, layer in enumerate(moe_layers)}
    missing = [layer for layer in layers if layer not in index]
    if missing:
        raise ParallelismError(
            f"layers {missing} are not MoE layers of the records {list(moe_layers)}"
        )
    return [index[layer] for layer in layers]
