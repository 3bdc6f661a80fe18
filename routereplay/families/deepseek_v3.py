"""DeepSeek-V3 (and Kimi-K2, the same architecture under ``model_type`` ``kimi_k2``):
multi-head latent attention with YaRN rope, GLM-4.5's router (sigmoid scores, selection-only
expert bias, group-limited top-k, scaling factor, shared experts), dense layers before
``first_k_dense_replace``, multi-token-prediction layers after the decoder.

The latent-attention part (``MLA_KEYS``, ``mla_fields``, ``refuse_mla``, ``mla_tiny``) is
DeepSeek-V2's too.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from routereplay.families.base import (
    COMMON_KEYS,
    Family,
    MoESize,
    UnsupportedConfig,
    WeightNames,
    rope_parameters,
    tiny_common,
)
from routereplay.families.glm4_moe import ROUTER_KEYS, moe_layers, refuse_sigmoid_group_routing

# Latent attention, the router's knobs (GLM-4.5's ``ROUTER_KEYS`` and ``topk_method``), and keys
# of DeepSeek's own config.json that do not change the maths (``pretraining_tp`` is 1 in every
# release; ``ep_size`` is an inference setting; ``aux_loss_alpha``/``seq_aux`` are replaced by
# the trainer's aux-loss setting; ``auto_map`` names remote code the trainer does not run).
MLA_KEYS = ROUTER_KEYS | frozenset(
    {
        "kv_lora_rank",
        "q_lora_rank",
        "qk_rope_head_dim",
        "qk_nope_head_dim",
        "qk_head_dim",
        "v_head_dim",
        "attention_bias",
        "topk_method",
        "scoring_func",
        "pretraining_tp",
        "ep_size",
        "aux_loss_alpha",
        "seq_aux",
        "auto_map",
    }
)
# The YaRN keys megatron's MLA maps (``MLATransformerConfig``).
_YARN_KEYS = {
    "rope_type",
    "rope_theta",
    "factor",
    "original_max_position_embeddings",
    "beta_fast",
    "beta_slow",
    "mscale",
    "mscale_all_dim",
}

# What the latent attention's rotary maps (YaRN with DeepSeek's two mscales, or plain rope).
MLA_ROPE_TYPES = frozenset({"default", "yarn"})
MLA_ROPE_KEYS = frozenset({"mscale", "mscale_all_dim"})

# The tiny models' latent sizes: vLLM's CPU MLA backend starts only with the real models'
# kv_lora_rank 512 and qk_rope_head_dim 64 ("Head dimension 48 is not supported by MLA" with
# 32 + 16); the other sizes stay tiny.
TINY_KV_LORA_RANK = 512
TINY_QK_ROPE_HEAD_DIM = 64
# YaRN as the real models configure it (factor 40 and 32 there), with mscale_all_dim unlike
# mscale so that both of its uses (the rotary amplitude and the softmax scale) matter.
TINY_YARN = dict(
    rope_type="yarn",
    rope_theta=10000.0,
    factor=4.0,
    original_max_position_embeddings=512,
    beta_fast=32,
    beta_slow=1,
    mscale=1.0,
    mscale_all_dim=0.8,
)


def mla_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The latent-attention and expert fields of ``MLATransformerConfig`` (both versions)."""
    heads = int(config["num_attention_heads"])
    moe_ffn = int(config["moe_intermediate_size"])
    q_lora = config.get("q_lora_rank")
    fields: dict[str, Any] = dict(
        multi_latent_attention=True,
        q_lora_rank=None if q_lora is None else int(q_lora),
        kv_lora_rank=int(config["kv_lora_rank"]),
        qk_head_dim=int(config["qk_nope_head_dim"]),
        qk_pos_emb_head_dim=int(config["qk_rope_head_dim"]),
        v_head_dim=int(config["v_head_dim"]),
        # megatron's local core attention sizes its output by kv_channels.
        kv_channels=int(config["v_head_dim"]),
        num_query_groups=heads,
        # q_a_layernorm / kv_a_layernorm: MLASelfAttention's q_layernorm / kv_layernorm.
        qk_layernorm=True,
        add_qkv_bias=False,
        moe_ffn_hidden_size=moe_ffn,
        moe_router_topk_scaling_factor=float(config.get("routed_scaling_factor") or 1.0),
        # transformers and vLLM compute these routers in float32 whatever the model's dtype.
        moe_router_dtype="fp32",
    )
    shared = int(config.get("n_shared_experts") or 0)
    if shared:
        fields.update(moe_shared_expert_intermediate_size=shared * moe_ffn)
    rope = rope_parameters(config)
    if rope["rope_type"] == "yarn":
        fields.update(
            rope_type="yarn",
            rotary_base=float(rope["rope_theta"]),
            rotary_scaling_factor=float(rope["factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
            beta_fast=float(rope.get("beta_fast", 32)),
            beta_slow=float(rope.get("beta_slow", 1)),
            mscale=float(rope["mscale"]),
            mscale_all_dim=float(rope["mscale_all_dim"]),
        )
    else:
        fields.update(rope_type="rope", rotary_base=float(rope["rope_theta"]))
    return fields


def refuse_mla(config: dict[str, Any]) -> None:
    """What megatron's latent attention computes differently from transformers and vLLM."""
    rope = rope_parameters(config)
    if rope["rope_type"] not in ("default", "yarn"):
        raise UnsupportedConfig(f"rope type {rope['rope_type']!r}: only yarn is mapped for MLA")
    if rope["rope_type"] == "yarn":
        unknown = sorted(set(rope) - _YARN_KEYS)
        if unknown:
            raise UnsupportedConfig(f"rope_parameters keys {unknown} are not mapped to megatron")
        if not rope.get("mscale") or not rope.get("mscale_all_dim"):
            # transformers then scales by yarn's default attention factor, megatron by
            # mscale / mscale_all_dim: equal only when both are given.
            raise UnsupportedConfig("yarn rope without mscale and mscale_all_dim is not mapped")
    if config.get("attention_bias"):
        raise UnsupportedConfig("attention_bias=True: latent-attention biases are not mapped")
    if not config.get("rope_interleave", True):
        # vLLM always rotates DeepSeek's interleaved pairs; megatron's MLA de-interleaves too.
        raise UnsupportedConfig("rope_interleave=False: vLLM rotates interleaved pairs")
    if float(config.get("rms_norm_eps", 1e-6)) != 1e-6:
        # transformers' q_a_layernorm / kv_a_layernorm use 1e-6 whatever rms_norm_eps says,
        # vLLM and megatron use rms_norm_eps.
        raise UnsupportedConfig("rms_norm_eps other than 1e-6: the engines' latent norms differ")
    heads = int(config["num_attention_heads"])
    if int(config.get("num_key_value_heads") or heads) != heads:
        raise UnsupportedConfig("num_key_value_heads != num_attention_heads with MLA")
    if int(config.get("moe_layer_freq") or 1) != 1:
        # transformers makes every layer from first_k_dense_replace on MoE, vLLM every
        # moe_layer_freq-th.
        raise UnsupportedConfig("moe_layer_freq other than 1: transformers ignores it")
    if int(config.get("pretraining_tp") or 1) != 1:
        raise UnsupportedConfig("pretraining_tp other than 1 is not mapped")


def megatron_fields(config: dict[str, Any]) -> dict[str, Any]:
    groups, kept = int(config.get("n_group") or 1), int(config.get("topk_group") or 1)
    fields = mla_fields(config)
    # sigmoid(logits) + e_score_correction_bias chooses the experts; the unbiased sigmoid
    # scores of the chosen ones, renormalised and scaled, weight them (as GLM-4.5).
    fields.update(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True)
    if groups > 1 and kept < groups:
        fields.update(moe_router_num_groups=groups, moe_router_group_topk=kept)
    return fields


def _refuse(config: dict[str, Any]) -> None:
    refuse_mla(config)
    # vLLM reads these two (transformers assumes them): without them it routes by softmax
    # and without the expert bias.
    if config.get("topk_method") != "noaux_tc":
        raise UnsupportedConfig(
            f"topk_method {config.get('topk_method')!r}: DeepSeek-V3's router is 'noaux_tc' "
            "(vLLM drops e_score_correction_bias otherwise)"
        )
    if config.get("scoring_func") != "sigmoid":
        raise UnsupportedConfig(
            f"scoring_func {config.get('scoring_func')!r}: DeepSeek-V3's router is 'sigmoid' "
            "(vLLM's default is softmax)"
        )
    refuse_sigmoid_group_routing(config)


def mla_tiny(size: MoESize, token_ids: dict[str, int]) -> dict[str, Any]:
    """The config arguments both tiny DeepSeek models share: latent attention (one key and
    value per query head), YaRN, a shared expert, layer 0 dense."""
    common = tiny_common(size, token_ids)
    del common["head_dim"]  # transformers sets it to qk_rope_head_dim
    common["num_key_value_heads"] = size.num_attention_heads
    return dict(
        **common,
        intermediate_size=size.intermediate_size,
        moe_intermediate_size=size.moe_intermediate_size,
        n_routed_experts=size.num_experts,
        n_shared_experts=1,
        first_k_dense_replace=1,
        kv_lora_rank=TINY_KV_LORA_RANK,
        qk_rope_head_dim=TINY_QK_ROPE_HEAD_DIM,
        qk_nope_head_dim=size.head_dim,
        v_head_dim=size.head_dim,
        rms_norm_eps=1e-6,
        rope_parameters=dict(TINY_YARN),
    )


def tiny_config(size: MoESize, token_ids: dict[str, int]):
    """GLM-4.5's tiny router (16 experts in 4 groups of which 2 are kept, top-4, a random
    selection-only expert bias set by the builder, scaling 2.5) with a ``q_lora_rank`` and
    one multi-token-prediction layer (its tensors added by the builder)."""
    import transformers

    return transformers.DeepseekV3Config(
        **mla_tiny(size, token_ids),
        q_lora_rank=2 * size.head_dim,
        n_group=size.num_experts_per_tok,
        topk_group=size.num_experts_per_tok // 2,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        num_nextn_predict_layers=1,
        # What DeepSeek-V3's config.json says and vLLM reads (transformers assumes both).
        topk_method="noaux_tc",
        scoring_func="sigmoid",
    )


CONFIG_KEYS = COMMON_KEYS | MLA_KEYS | {"rope_interleave", "num_nextn_predict_layers"}
TINY_SIZE = MoESize(num_experts=16, num_experts_per_tok=4)

FAMILY = Family(
    model_type="deepseek_v3",
    moe_layers=moe_layers,
    config_keys=CONFIG_KEYS,
    megatron_fields=megatron_fields,
    weights=WeightNames("mlp.", shared="mlp.shared_experts."),
    tiny_config=tiny_config,
    tiny_size=TINY_SIZE,
    refuse=_refuse,
    rope_types=MLA_ROPE_TYPES,
    rope_keys=MLA_ROPE_KEYS,
    mtp_layers=True,
)


def _no_tiny_kimi(size: MoESize, token_ids: dict[str, int]):
    raise UnsupportedConfig(
        "transformers 5.17 has no kimi_k2 config; build the tiny deepseek_v3 (the same "
        "architecture) and set its model_type"
    )


# Kimi-K2's config.json says model_type "kimi_k2" with DeepseekV3ForCausalLM and DeepSeek-V3's
# keys (vLLM maps kimi_k2 to its DeepseekV3Config; transformers 5.17 has no kimi_k2 config, its
# Kimi-K2.5 reads a kimi_k2 text config as deepseek_v3).
KIMI_K2 = dataclasses.replace(FAMILY, model_type="kimi_k2", tiny_config=_no_tiny_kimi)
