"""GLM-4.5: DeepSeek-V3's router (sigmoid scores, selection-only expert bias, group-limited
top-k, scaling factor, shared experts) with ordinary attention, partial rotary and qk-norm;
like DeepSeek-V3, a multi-token-prediction layer after the decoder in every release."""

from __future__ import annotations

from typing import Any

from routereplay.families.base import (
    COMMON_KEYS,
    Family,
    MoESize,
    UnsupportedConfig,
    WeightNames,
    first_of,
    tiny_common,
)

# DeepSeek-V3's MoE block and router, as GLM-4.5, DeepSeek-V2/V3 and Kimi-K2 configure them.
ROUTER_KEYS = frozenset(
    {
        "first_k_dense_replace",
        "moe_intermediate_size",
        "moe_layer_freq",
        "n_group",
        "topk_group",
        "n_routed_experts",
        "n_shared_experts",
        "norm_topk_prob",
        "routed_scaling_factor",
    }
)


def moe_layers(config: dict[str, Any]) -> tuple[list[int], int]:
    """DeepSeek-V2/V3 and GLM-4.5: the first ``first_k_dense_replace`` layers are dense, then
    every ``moe_layer_freq``-th layer is MoE (vLLM's rule; the frequency is 1 in V3 and absent
    from GLM-4.5). Multi-token-prediction layers (``num_nextn_predict_layers``) come after
    ``num_hidden_layers``."""
    num_experts = int(first_of(config, "n_routed_experts", "num_local_experts"))
    first_dense = int(first_of(config, "first_k_dense_replace", default=0) or 0)
    freq = int(first_of(config, "moe_layer_freq", default=1))
    layers = [i for i in range(config["num_hidden_layers"]) if i >= first_dense and i % freq == 0]
    return layers, num_experts


def megatron_fields(config: dict[str, Any]) -> dict[str, Any]:
    moe_ffn = int(config["moe_intermediate_size"])
    groups, kept = int(config.get("n_group") or 1), int(config.get("topk_group") or 1)
    fields = dict(
        qk_layernorm=bool(config.get("use_qk_norm", False)),
        add_qkv_bias=bool(config.get("attention_bias", False)),
        moe_ffn_hidden_size=moe_ffn,
        # sigmoid(logits) + e_score_correction_bias chooses the experts; the unbiased sigmoid
        # scores of the chosen ones, renormalised and scaled, weight them.
        moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True,
        moe_router_topk_scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
        # transformers and vLLM compute this router in float32 whatever the model's dtype. In
        # bf16, megatron would round the sigmoid scores to bf16 (steps of 2^-8 near 1), tie
        # experts and choose differently: measured 2-24% agreement with the float32 rollout
        # per layer on the tiny model in the main job, against 94-100% with float32 routing.
        moe_router_dtype="fp32",
    )
    if groups > 1 and kept < groups:
        fields.update(moe_router_num_groups=groups, moe_router_group_topk=kept)
    shared = int(config.get("n_shared_experts") or 0)
    if shared:
        fields.update(moe_shared_expert_intermediate_size=shared * moe_ffn)
    return fields


def refuse_sigmoid_group_routing(config: dict[str, Any]) -> None:
    """Sigmoid routers: megatron always renormalises the top-k scores and ranks each group by
    the sum of its top ``topk // group_topk`` scores, where transformers and vLLM sum the top 2."""
    if not config.get("norm_topk_prob", True):
        raise UnsupportedConfig(
            "norm_topk_prob=False with sigmoid scores: megatron always renormalises them"
        )
    groups, kept = int(config.get("n_group") or 1), int(config.get("topk_group") or 1)
    topk = int(config["num_experts_per_tok"])
    if 1 < groups and kept < groups and topk // kept != 2:
        raise UnsupportedConfig(
            f"n_group {groups}, topk_group {kept}, num_experts_per_tok {topk}: megatron ranks "
            f"groups by their top {topk // kept} scores, transformers and vLLM by their top 2"
        )


def tiny_config(size: MoESize, token_ids: dict[str, int]):
    """16 experts in 4 groups of which 2 are kept, top-4, a random selection-only expert bias
    (set by the builder), ``routed_scaling_factor`` 2.5, a shared expert,
    ``first_k_dense_replace`` 1, partial rotary (half the head), qk-norm, qkv bias, and one
    multi-token-prediction layer (its tensors added by the builder), as every GLM-4.5 and
    GLM-4.5-Air checkpoint has."""
    import transformers

    return transformers.Glm4MoeConfig(
        **tiny_common(size, token_ids),
        intermediate_size=size.intermediate_size,
        moe_intermediate_size=size.moe_intermediate_size,
        n_routed_experts=size.num_experts,
        n_shared_experts=1,
        # DeepSeek-V3's grouping: each kept group holds 2 of the top-k (megatron ranks groups
        # by the sum of their top k / topk_group scores, transformers and vLLM by their top 2):
        # 4 groups, 2 kept for the tiny top-4; 8 groups, 4 kept for BENCH_SIZE's top-8.
        n_group=size.num_experts_per_tok,
        topk_group=size.num_experts_per_tok // 2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        partial_rotary_factor=0.5,
        use_qk_norm=True,
        attention_bias=True,
        num_nextn_predict_layers=1,
    )


FAMILY = Family(
    model_type="glm4_moe",
    moe_layers=moe_layers,
    config_keys=COMMON_KEYS
    | ROUTER_KEYS
    | {"attention_bias", "use_qk_norm", "partial_rotary_factor", "num_nextn_predict_layers"},
    megatron_fields=megatron_fields,
    weights=WeightNames("mlp.", shared="mlp.shared_experts."),
    tiny_config=tiny_config,
    # Group-limited routing needs more than 8 experts: 4 groups of 4, top-4.
    tiny_size=MoESize(num_experts=16, num_experts_per_tok=4),
    refuse=refuse_sigmoid_group_routing,
    partial_rotary=True,
    mtp_layers=True,
)
