"""DeepSeek-V2: multi-head latent attention (no query compression in V2-Lite) with a softmax
router: plain top-k (``greedy``) or group-limited greedy (each group ranked by its best
expert), scores not renormalised, times ``routed_scaling_factor``; shared experts."""

from __future__ import annotations

from typing import Any

from routereplay.families.base import COMMON_KEYS, Family, MoESize, UnsupportedConfig, WeightNames
from routereplay.families.deepseek_v3 import (
    MLA_KEYS,
    MLA_ROPE_KEYS,
    MLA_ROPE_TYPES,
    mla_fields,
    mla_tiny,
    moe_layers,
    refuse_mla,
)


def _grouped(config: dict[str, Any]) -> bool:
    return config.get("topk_method", "greedy") == "group_limited_greedy"


def megatron_fields(config: dict[str, Any]) -> dict[str, Any]:
    fields = mla_fields(config)
    # softmax over every expert, the top-k of those probabilities, never renormalised.
    fields.update(moe_router_score_function="softmax", moe_router_pre_softmax=True)
    if _grouped(config):
        fields.update(
            moe_router_num_groups=int(config["n_group"]),
            moe_router_group_topk=int(config["topk_group"]),
        )
    return fields


def _refuse(config: dict[str, Any]) -> None:
    refuse_mla(config)
    method = config.get("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        raise UnsupportedConfig(f"topk_method {method!r} is not mapped for deepseek_v2")
    if config.get("scoring_func", "softmax") != "softmax":
        raise UnsupportedConfig(f"scoring_func {config['scoring_func']!r}: V2 routes by softmax")
    if config.get("norm_topk_prob"):
        # transformers' V2 router never renormalises; vLLM does when this is set.
        raise UnsupportedConfig("norm_topk_prob=True: transformers and vLLM differ for V2")
    if config.get("mlp_bias"):
        raise UnsupportedConfig("mlp_bias=True is not mapped to megatron")
    if _grouped(config):
        topk, kept = int(config["num_experts_per_tok"]), int(config["topk_group"])
        if topk // kept != 1:
            # megatron ranks a group by the sum of its top (topk // group_topk) scores,
            # transformers and vLLM by its best expert alone (DeepSeek-V2 itself: top-6 of 3
            # groups, so megatron would sum 2).
            raise UnsupportedConfig(
                f"topk_method group_limited_greedy with num_experts_per_tok {topk} and "
                f"topk_group {kept}: megatron ranks groups by their top {topk // kept} "
                "scores, transformers and vLLM by their best one"
            )


def tiny_config(size: MoESize, token_ids: dict[str, int]):
    """No ``q_lora_rank``; 16 experts in 8 groups of 2, 3 groups kept, top-4 (megatron ranks
    groups by their top 4 // 3 = 1 scores, as transformers and vLLM; with as many groups kept
    as experts chosen the limit would never change a choice), scaling 1.5, YaRN."""
    import transformers

    return transformers.DeepseekV2Config(
        **mla_tiny(size, token_ids),
        q_lora_rank=None,
        topk_method="group_limited_greedy",
        n_group=2 * size.num_experts_per_tok,
        topk_group=size.num_experts_per_tok - 1,
        routed_scaling_factor=1.5,
        norm_topk_prob=False,
    )


FAMILY = Family(
    model_type="deepseek_v2",
    moe_layers=moe_layers,
    config_keys=COMMON_KEYS | MLA_KEYS | {"mlp_bias"},
    megatron_fields=megatron_fields,
    weights=WeightNames("mlp.", shared="mlp.shared_experts."),
    tiny_config=tiny_config,
    tiny_size=MoESize(num_experts=16, num_experts_per_tok=4),
    refuse=_refuse,
    rope_types=MLA_ROPE_TYPES,
    rope_keys=MLA_ROPE_KEYS,
)
