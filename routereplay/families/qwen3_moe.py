"""Qwen3-MoE: qk-norm, no biases, softmax router (``norm_topk_prob``: over the top-k logits)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from routereplay.families.base import (
    COMMON_KEYS,
    VOCAB_SIZE,
    Family,
    MoESize,
    UnsupportedConfig,
    WeightNames,
    first_of,
)

# The keys Qwen2-MoE shares.
QWEN_KEYS = frozenset(
    {
        "moe_intermediate_size",
        "num_experts",
        "num_local_experts",
        "mlp_only_layers",
        "decoder_sparse_step",
        "norm_topk_prob",
        "use_sliding_window",
        "sliding_window",
        "max_window_layers",
        "layer_types",
    }
)


def megatron_fields(config: dict[str, Any]) -> dict[str, Any]:
    return dict(
        qk_layernorm=True,
        add_qkv_bias=False,
        moe_ffn_hidden_size=int(config["moe_intermediate_size"]),
        moe_router_score_function="softmax",
        # norm_topk_prob: softmax over the top-k logits (= renormalised top-k probabilities);
        # without it, softmax over all experts first.
        moe_router_pre_softmax=not bool(config.get("norm_topk_prob", False)),
    )


def _refuse(config: dict[str, Any]) -> None:
    if config.get("attention_bias"):
        raise UnsupportedConfig("attention_bias=True is not mapped to megatron for qwen3_moe")


def tiny_config(size: MoESize, token_ids: dict[str, int]):
    """Layer 0 dense, the others MoE; qk-norm, ``norm_topk_prob``."""
    import transformers

    # Field order as before families existed, so the default files stay byte-identical.
    return transformers.Qwen3MoeConfig(
        vocab_size=VOCAB_SIZE,
        **asdict(size),
        mlp_only_layers=[0],
        decoder_sparse_step=1,
        norm_topk_prob=True,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        dtype="float32",
        **token_ids,
    )


def moe_layers(config: dict[str, Any]) -> tuple[list[int], int]:
    """Qwen2-MoE / Qwen3-MoE: a layer is MoE unless listed in ``mlp_only_layers``, and only
    every ``decoder_sparse_step``-th layer (1-based) is sparse."""
    num_experts = int(first_of(config, "num_experts", "num_local_experts"))
    dense = set(config.get("mlp_only_layers") or [])
    step = int(first_of(config, "decoder_sparse_step", default=1))
    layers = [
        i
        for i in range(config["num_hidden_layers"])
        if i not in dense and num_experts > 0 and (i + 1) % step == 0
    ]
    return layers, num_experts


FAMILY = Family(
    model_type="qwen3_moe",
    moe_layers=moe_layers,
    config_keys=COMMON_KEYS | QWEN_KEYS | {"attention_bias"},
    megatron_fields=megatron_fields,
    weights=WeightNames("mlp."),
    tiny_config=tiny_config,
    refuse=_refuse,
)
