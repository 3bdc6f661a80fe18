"""Qwen2-MoE: Qwen3-MoE's router without qk-norm, with qkv bias and a gated shared expert."""

from __future__ import annotations

from typing import Any

from routereplay.families import qwen3_moe
from routereplay.families.base import COMMON_KEYS, Family, MoESize, WeightNames, tiny_common


def megatron_fields(config: dict[str, Any]) -> dict[str, Any]:
    fields = qwen3_moe.megatron_fields(config)
    fields.update(qk_layernorm=False, add_qkv_bias=bool(config.get("qkv_bias", True)))
    shared = int(config.get("shared_expert_intermediate_size") or 0)
    if shared:
        # One shared expert, its output scaled by sigmoid(x @ shared_expert_gate).
        fields.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
    return fields


def tiny_config(size: MoESize, token_ids: dict[str, int]):
    """Layer 0 dense; a shared expert with its sigmoid gate, qkv bias, ``norm_topk_prob``
    false, no qk-norm."""
    import transformers

    return transformers.Qwen2MoeConfig(
        **tiny_common(size, token_ids),
        intermediate_size=size.intermediate_size,
        moe_intermediate_size=size.moe_intermediate_size,
        shared_expert_intermediate_size=2 * size.moe_intermediate_size,
        num_experts=size.num_experts,
        mlp_only_layers=[0],
        decoder_sparse_step=1,
        norm_topk_prob=False,
        qkv_bias=True,
    )


FAMILY = Family(
    model_type="qwen2_moe",
    moe_layers=qwen3_moe.moe_layers,
    config_keys=COMMON_KEYS | qwen3_moe.QWEN_KEYS | {"qkv_bias", "shared_expert_intermediate_size"},
    megatron_fields=megatron_fields,
    weights=WeightNames("mlp.", shared="mlp.shared_expert.", shared_gate="mlp.shared_expert_gate."),
    tiny_config=tiny_config,
)
