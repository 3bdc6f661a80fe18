"""Mixtral: every layer MoE, experts ``intermediate_size`` wide, softmax over the top-k logits."""

from __future__ import annotations

from typing import Any

from routereplay.families.base import (
    COMMON_KEYS,
    Family,
    MoESize,
    UnsupportedConfig,
    WeightNames,
    every_layer_moe,
    tiny_common,
)


def megatron_fields(config: dict[str, Any]) -> dict[str, Any]:
    return dict(
        qk_layernorm=False,
        add_qkv_bias=False,
        # Mixtral's experts are intermediate_size wide; it has no dense layer.
        moe_ffn_hidden_size=int(config["intermediate_size"]),
        moe_router_score_function="softmax",
        moe_router_pre_softmax=False,  # softmax over the top-k logits
    )


def _refuse(config: dict[str, Any]) -> None:
    if config.get("sliding_window") is not None:
        raise UnsupportedConfig("sliding_window: sliding-window attention is not mapped")


def tiny_config(size: MoESize, token_ids: dict[str, int]):
    """Every layer MoE (8 experts, top-2)."""
    import transformers

    return transformers.MixtralConfig(
        **tiny_common(size, token_ids),
        intermediate_size=size.moe_intermediate_size,
        num_local_experts=size.num_experts,
    )


FAMILY = Family(
    model_type="mixtral",
    moe_layers=lambda config: every_layer_moe(config, "num_local_experts", "num_experts"),
    config_keys=COMMON_KEYS | {"num_local_experts", "sliding_window", "router_jitter_noise"},
    megatron_fields=megatron_fields,
    weights=WeightNames("block_sparse_moe.", ("w1", "w3", "w2")),
    tiny_config=tiny_config,
    refuse=_refuse,
)
