"""Build the served Hugging Face MoE checkpoint (any family ``hf_config`` maps) as megatron-core
``GPTModel`` chunks, replay installed."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from routereplay.domain.record import Geometry
from trainer.model import replay
from trainer.model.hf_config import (
    CheckpointConfig,
    UnsupportedConfig,
    read_checkpoint_config,
    transformer_config,
)
from trainer.model.hf_weights import hf_to_megatron, load_hf_state_dict
from trainer.model.shard_weights import local_weights
from trainer.patches import cpu_compat, megatron_fixes, mla_compat
from trainer.sharding import PipelineSplit, check_stage_routers, stage_moe_layers


def _pipeline_rank(pg_collection) -> tuple[int, int]:
    """(rank, size) of this process in the pipeline group (``pg_collection.pp``, else
    megatron's global one; (0, 1) without pipeline parallelism)."""
    group = getattr(pg_collection, "pp", None) if pg_collection is not None else None
    if group is not None:
        return group.rank(), group.size()
    from megatron.core import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    return (
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )


@dataclass
class TrainerModel:
    """A built model and what the trainer needs beside it.

    Attributes:
        chunks: This rank's megatron ``GPTModel`` chunks, one per virtual pipeline stage (one
            without virtual stages), in virtual-stage order: the ``model`` list megatron's
            schedules take. Parameters on the CPU without CUDA.
        checkpoint: The checkpoint's checked ``config.json`` (for exporting weights back).
        geometry: The routing geometry of the whole model, in the record's terms.
        routers: This rank's routers (its pipeline stage's, every chunk's) in ascending global
            layer order.
        replay: Replay control of those routers; None when replay is off.
        controls: Per chunk, the replay control of its routers (what a forward step of that
            chunk replays); None when replay is off.
    """

    chunks: list[torch.nn.Module]
    checkpoint: CheckpointConfig
    geometry: Geometry
    routers: list[replay.ReplayRouter]
    replay: replay.RouterReplayControl | None
    controls: list[replay.RouterReplayControl] | None = None

    def __post_init__(self):
        # One module for the optimizer, gradient sums and checkpoints: the chunk itself, or
        # the chunks as a ModuleList under virtual stages.
        self.model = self.chunks[0] if len(self.chunks) == 1 else torch.nn.ModuleList(self.chunks)

    def vp_stage(self, chunk: torch.nn.Module) -> int:
        """The virtual stage of a chunk the schedule handed over."""
        return next(v for v, m in enumerate(self.chunks) if m is chunk)


def check_replay_config(config) -> None:
    """Refuse megatron settings that would bypass or undo the replayed routing.

    Args:
        config: A ``TransformerConfig`` with ``moe_enable_routing_replay`` set.

    Raises:
        UnsupportedConfig: naming the setting and why.
    """
    if config.moe_router_fusion:
        # topk_routing_with_score_function returns the fused kernel's result before it ever
        # consults router_replay.
        raise UnsupportedConfig(
            "moe_router_fusion=True bypasses router replay (the fused top-k kernel never calls "
            "RouterReplay); set it to False when router_replay.mode is R2 or R3"
        )
    if config.moe_router_load_balancing_type == "sinkhorn":
        # TopKRouter.routing takes the sinkhorn branch, which has no replay hook.
        raise UnsupportedConfig(
            "moe_router_load_balancing_type='sinkhorn' bypasses router replay; use 'none', "
            "'aux_loss' or 'seq_aux_loss' with router_replay.mode R2 or R3"
        )
    if config.moe_expert_capacity_factor is not None:
        # apply_router_token_dropping would drop replayed assignments after the fact.
        raise UnsupportedConfig(
            "moe_expert_capacity_factor drops tokens after routing, so the experts used would "
            "differ from the replayed ones; leave it unset with router replay"
        )


def load_checkpoint(model: torch.nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Load this rank's share of the checkpoint into ``model`` (any TP / EP / PP / VP sizes).

    Args:
        model: This rank's ``GPTModel`` (a pipeline stage or virtual-stage chunk).
        full: The whole checkpoint under megatron's names (``hf_weights.hf_to_megatron``).

    Raises:
        UnsupportedConfig: A parameter without a source or with a wrongly shaped slice.
    """
    # local_weights covers every entry of the model's state dict but _extra_state.
    model.load_state_dict(local_weights(model, full), strict=False)


def megatron_config(
    model_dir: str | Path,
    routing_replay: bool,
    load_weights: bool,
    overrides: dict[str, Any],
    drop_mtp_layers: bool = True,
) -> tuple[CheckpointConfig, Any]:
    """The checkpoint's checked ``config.json`` and the ``TransformerConfig`` built from it
    (with the CPU patches and megatron fixes applied first, the pipeline split and a replay
    configuration checked).

    Raises:
        ParallelismError: A pipeline split that does not place the model's layers.
        UnsupportedConfig: A setting replay cannot run with.
    """
    cpu_compat.apply()
    megatron_fixes.apply()
    checkpoint = read_checkpoint_config(model_dir)
    if checkpoint.mtp_layers and not drop_mtp_layers:
        # megatron-core 0.19's MTP block (mtp_num_layers) returns the decoder's logits, but in
        # every training forward it adds its own next-token loss on the sample's tokens (labels
        # rolled from the input ids) to the gradient, and its MoE layer routes tokens no rollout
        # recorded routes for: the RL step's objective would not be the one trained.
        raise UnsupportedConfig(
            f"num_nextn_predict_layers {checkpoint.mtp_layers}: megatron's multi-token-"
            "prediction block adds its own next-token loss to the RL step's gradient and its "
            "layers have no recorded routes; set model.drop_mtp_layers to train the decoder "
            "alone"
        )
    settings: dict[str, Any] = {"use_cpu_initialization": not torch.cuda.is_available()}
    if load_weights:
        settings["perform_initialization"] = False  # every parameter is loaded afterwards
    settings.update(overrides)
    # Megatron asserts on a split it cannot build; this names the split in the sizes' terms.
    PipelineSplit(
        num_layers=int(checkpoint.raw["num_hidden_layers"]),
        pp=settings.get("pipeline_model_parallel_size", 1),
        vp=settings.get("virtual_pipeline_model_parallel_size"),
        first=settings.get("num_layers_in_first_pipeline_stage"),
        last=settings.get("num_layers_in_last_pipeline_stage"),
    ).chunk_sizes()
    config = transformer_config(checkpoint, routing_replay=routing_replay, **settings)
    if (
        getattr(config, "multi_latent_attention", False)
        and config.tensor_model_parallel_size > 1
        and not config.sequence_parallel
    ):
        # mla_compat.fix_tensor_parallel corrects megatron's latent attention under TP with
        # sequence parallelism only.
        raise UnsupportedConfig(
            "tensor parallelism with multi-head latent attention needs sequence parallelism "
            "(parallel.sequence_parallel=true)"
        )
    if routing_replay:
        check_replay_config(config)
    return checkpoint, config


def moe_routers(model: torch.nn.Module) -> list[replay.ReplayRouter]:
    """The model's top-k routers by global (0-based) decoder layer number, ascending.

    Megatron's ``TransformerLayer.layer_number`` is 1-based and already includes this pipeline
    stage's offset, so the numbers match the record's ``Geometry.moe_layers``.
    """
    routers = []
    for layer in model.decoder.layers:
        router = getattr(layer.mlp, "router", None)
        if router is not None:
            routers.append(replay.ReplayRouter(layer=layer.layer_number - 1, router=router))
    return sorted(routers, key=lambda r: r.layer)


def build_model(
    model_dir: str | Path,
    *,
    routing_replay: bool,
    pg_collection=None,
    load_weights: bool = True,
    model_id: str | None = None,
    drop_mtp_layers: bool = True,
    **config_overrides: Any,
) -> TrainerModel:
    """Build this rank's megatron ``GPTModel`` chunks from a local Hugging Face MoE checkpoint
    folder (any family ``hf_config`` maps): its pipeline stage, one chunk per virtual stage.

    Args:
        model_dir: Folder with ``config.json`` and safetensors weights.
        routing_replay: Turn on megatron's ``moe_enable_routing_replay`` and install masked
            replay on every router (R2 and R3); refuses settings that bypass replay.
        pg_collection: megatron ``ProcessGroupCollection`` (``single_process.init_single_process``
            returns one); megatron's global groups when None.
        load_weights: Load the checkpoint's weights, this rank's share of them under the
            parallel sizes (else initialised from the seed, the same on every rank).
        model_id: Identifier stored in ``geometry`` (default: the folder's name).
        drop_mtp_layers: Leave the checkpoint's multi-token-prediction layers
            (``num_nextn_predict_layers``) out of the model: they are never decoder layers,
            own no router of the model and take no routes; exports carry them over unchanged.
            False refuses such a checkpoint.
        **config_overrides: Extra ``TransformerConfig`` fields
            (``world.model_overrides`` gives the parallel sizes', virtual stages among them).

    Returns:
        The ``TrainerModel``.

    Raises:
        UnsupportedConfig: A setting replay cannot run with.
        ParallelismError: A chunk's routers differ from its share of the MoE layers
            (``sharding.stage_moe_layers``).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe.router_replay import RouterReplay

    checkpoint, config = megatron_config(
        model_dir, routing_replay, load_weights, config_overrides, drop_mtp_layers
    )
    # The registry is class-level: without a reset, a second build would double-register.
    RouterReplay.clear_global_router_replay_instances()
    pp_rank, pp_size = _pipeline_rank(pg_collection)
    vp = config.virtual_pipeline_model_parallel_size
    geometry = replace(checkpoint.geometry, model_id=model_id or Path(model_dir).name)
    split = PipelineSplit.from_config(config)
    full = hf_to_megatron(load_hf_state_dict(model_dir), checkpoint) if load_weights else None
    chunks, chunk_routers = [], []
    for v in range(vp or 1):
        stage = {} if vp is None else {"vp_stage": v}
        spec = mla_compat.decoder_block_spec(config, normalization="RMSNorm", **stage)
        model = GPTModel(
            config,
            spec,
            pg_collection=pg_collection,
            pre_process=pp_rank == 0 and v == 0,
            post_process=pp_rank == pp_size - 1 and v == (vp or 1) - 1,
            **stage,
            **checkpoint.model_args.as_kwargs(),
        )
        mla_compat.fix_tensor_parallel(model)
        if full is not None:
            load_checkpoint(model, full)
        routers = moe_routers(model)
        # Each stage (and chunk) owns the routers of its own layers only (megatron's split).
        expected = stage_moe_layers(
            split, geometry.moe_layers, pp_rank, vp_stage=stage.get("vp_stage")
        )
        where = f"pipeline stage {pp_rank} of {pp_size}" + (f", virtual stage {v}" if vp else "")
        check_stage_routers(expected, [r.layer for r in routers], f"{where}: ")
        chunks.append(model)
        chunk_routers.append(routers)
    routers = [r for rs in chunk_routers for r in rs]
    if not routing_replay:
        return TrainerModel(chunks, checkpoint, geometry, routers, None)
    # One install for every chunk: it resets megatron's class-level registry each time.
    control = replay.install(routers)
    controls = [replay.RouterReplayControl(rs) for rs in chunk_routers]
    return TrainerModel(chunks, checkpoint, geometry, routers, control, controls)
