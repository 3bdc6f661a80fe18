"""Build the served Hugging Face Qwen3-MoE as a megatron-core ``GPTModel``, replay installed."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from routereplay.record import Geometry
from trainer import cpu_compat, replay
from trainer.hf_config import (
    UnsupportedConfig,
    gpt_model_args,
    model_geometry,
    read_hf_config,
    transformer_config,
)
from trainer.hf_weights import hf_to_megatron, load_hf_state_dict
from trainer.reshard import PipelineSplit, stage_moe_layers
from trainer.shard_weights import local_weights


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
        model: The megatron ``GPTModel`` (parameters on the CPU without CUDA).
        hf_config: The checkpoint's parsed ``config.json`` (for exporting weights back).
        geometry: The routing geometry of the whole model, in the record's terms.
        routers: This model's routers (this pipeline stage's only) in ascending global layer
            order.
        replay: Replay control of those routers; None when replay is off.
    """

    model: torch.nn.Module
    hf_config: dict[str, Any]
    geometry: Geometry
    routers: list[replay.ReplayRouter]
    replay: replay.RouterReplayControl | None


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
    """Load this rank's share of the checkpoint into ``model`` (any TP / EP / PP / VP layout).

    Args:
        model: This rank's ``GPTModel`` (a pipeline stage or virtual-stage chunk).
        full: The whole checkpoint under megatron's names (``hf_weights.hf_to_megatron``).

    Raises:
        UnsupportedConfig: A parameter without a source or with a wrongly shaped slice.
    """
    # local_weights covers every entry of the model's state dict but _extra_state.
    model.load_state_dict(local_weights(model, full), strict=False)


def megatron_config(
    model_dir: str | Path, routing_replay: bool, load_weights: bool, overrides: dict[str, Any]
) -> tuple[dict[str, Any], Any]:
    """The checkpoint's ``config.json`` and the ``TransformerConfig`` built from it (with the
    CPU patches applied first, and a replay configuration checked)."""
    cpu_compat.apply()
    hf_config = read_hf_config(model_dir)
    settings: dict[str, Any] = {"use_cpu_initialization": not torch.cuda.is_available()}
    if load_weights:
        settings["perform_initialization"] = False  # every parameter is loaded afterwards
    settings.update(overrides)
    config = transformer_config(hf_config, routing_replay=routing_replay, **settings)
    if routing_replay:
        check_replay_config(config)
    return hf_config, config


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
    **config_overrides: Any,
) -> TrainerModel:
    """Build a megatron ``GPTModel`` from a local Hugging Face Qwen3-MoE checkpoint folder.

    Args:
        model_dir: Folder with ``config.json`` and safetensors weights.
        routing_replay: Turn on megatron's ``moe_enable_routing_replay`` and install masked
            replay on every router (R2 and R3); refuses settings that bypass replay.
        pg_collection: megatron ``ProcessGroupCollection`` (``distributed.init_single_process``
            returns one); megatron's global groups when None.
        load_weights: Load the checkpoint's weights, this rank's share of them in a parallel
            layout (else uninitialised parameters).
        model_id: Identifier stored in ``geometry`` (default: the folder's name).
        **config_overrides: Extra ``TransformerConfig`` fields.

    Returns:
        The ``TrainerModel``.
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
    from megatron.core.transformer.moe.router_replay import RouterReplay

    hf_config, config = megatron_config(model_dir, routing_replay, load_weights, config_overrides)
    # The registry is class-level: without a reset, a second build would double-register.
    RouterReplay.clear_global_router_replay_instances()
    if config.virtual_pipeline_model_parallel_size is not None:
        raise UnsupportedConfig(
            "virtual pipeline stages: build_model builds one model chunk per rank; "
            "interleaved (virtual) stages are not wired in yet"
        )
    pp_rank, pp_size = _pipeline_rank(pg_collection)
    spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False, normalization="RMSNorm")
    model = GPTModel(
        config,
        spec,
        pg_collection=pg_collection,
        pre_process=pp_rank == 0,
        post_process=pp_rank == pp_size - 1,
        **gpt_model_args(hf_config).as_kwargs(),
    )
    if load_weights:
        load_checkpoint(model, hf_to_megatron(load_hf_state_dict(model_dir), hf_config))
    routers = moe_routers(model)
    control = replay.install(routers) if routing_replay else None
    geometry = model_geometry(hf_config, model_id or Path(model_dir).name)
    # Each pipeline stage owns the routers of its own layers only (megatron's layer split).
    expected = stage_moe_layers(
        PipelineSplit.from_config(config), geometry.moe_layers, pp_rank, vp_stage=None
    )
    if tuple(r.layer for r in routers) != expected:
        raise UnsupportedConfig(
            f"megatron built routers on layers {[r.layer for r in routers]}; the checkpoint's "
            f"MoE layers are {list(geometry.moe_layers)}, of which pipeline stage {pp_rank} "
            f"of {pp_size} owns {list(expected)}"
        )
    return TrainerModel(model, hf_config, geometry, routers, control)
