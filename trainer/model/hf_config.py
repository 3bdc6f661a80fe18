"""A Hugging Face MoE ``config.json`` as megatron-core's ``TransformerConfig``, per family.

Every field below was needed for logit parity with transformers on the CPU in float32 (see
docs/trainer.md): a wrong qkv layout, ``rotary_interleaved``, ``qk_layernorm``, rotary base,
fc1 order, ``moe_router_pre_softmax``, norm epsilon or ``kv_channels`` each broke it.

Each supported ``model_type`` lists every ``config.json`` key its mapping understands
(``_KEYS``); a checkpoint with any other key is refused before anything is built, naming the
key, since an unknown key may change the model's maths.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from routereplay.domain.model_geometry import geometry_from_config
from routereplay.domain.record import Geometry

# Keys every family shares, which either feed the mapping below or do not change the maths
# (token ids, bookkeeping, inference-only switches, the aux-loss coefficient the trainer's own
# configuration replaces).
_COMMON_KEYS = frozenset({
    "architectures", "model_type", "transformers_version", "dtype", "torch_dtype",
    "bos_token_id", "eos_token_id", "pad_token_id", "use_cache", "initializer_range",
    "output_router_logits", "router_aux_loss_coef", "output_attentions",
    "output_hidden_states", "return_dict", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings", "rope_parameters",
    "rope_theta", "rope_scaling", "attention_dropout", "hidden_act", "num_experts_per_tok",
})  # fmt: skip
_QWEN_KEYS = frozenset({
    "moe_intermediate_size", "num_experts", "num_local_experts", "mlp_only_layers",
    "decoder_sparse_step", "norm_topk_prob", "use_sliding_window", "sliding_window",
    "max_window_layers", "layer_types",
})  # fmt: skip
_KEYS: dict[str, frozenset[str]] = {
    "qwen3_moe": _COMMON_KEYS | _QWEN_KEYS | {"attention_bias"},
    "qwen2_moe": _COMMON_KEYS | _QWEN_KEYS | {"qkv_bias", "shared_expert_intermediate_size"},
    "mixtral": _COMMON_KEYS | {"num_local_experts", "sliding_window", "router_jitter_noise"},
    "glm4_moe": _COMMON_KEYS | {
        "attention_bias", "first_k_dense_replace", "moe_intermediate_size", "n_group",
        "topk_group", "n_routed_experts", "n_shared_experts", "norm_topk_prob",
        "routed_scaling_factor", "use_qk_norm", "partial_rotary_factor",
        "num_nextn_predict_layers", "moe_layer_freq",
    },
}  # fmt: skip
SUPPORTED_MODEL_TYPES = tuple(_KEYS)


class UnsupportedConfig(ValueError):
    """The checkpoint or a trainer setting cannot be run (or replayed) faithfully."""


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a local Hugging Face checkpoint folder."""
    return json.loads((Path(model_dir) / "config.json").read_text())


def _get(config: dict[str, Any], *keys: str) -> Any:
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    raise UnsupportedConfig(f"config.json lacks all of {keys}")


def num_experts(config: dict[str, Any]) -> int:
    return model_geometry(config).num_experts


def rope_theta(config: dict[str, Any]) -> float:
    # transformers 5.x moved rope_theta (and partial_rotary_factor) into rope_parameters.
    params = config.get("rope_parameters") or {}
    unknown = set(params) - {"rope_type", "rope_theta", "partial_rotary_factor"}
    if unknown:
        raise UnsupportedConfig(f"rope_parameters keys {sorted(unknown)} are not mapped")
    rope_type = params.get("rope_type", "default")
    if rope_type != "default" or config.get("rope_scaling"):
        raise UnsupportedConfig(f"rope scaling {rope_type!r} is not mapped to megatron yet")
    if params.get("rope_theta") is not None:
        return float(params["rope_theta"])
    return float(_get(config, "rope_theta"))


def model_geometry(config: dict[str, Any], model_id: str = "") -> Geometry:
    """The routing geometry of this model, in the record's terms (global MoE layer numbers),
    by the same per-family rule the rollout server applies."""
    try:
        return geometry_from_config(config, model_id).record
    except ValueError as exc:
        raise UnsupportedConfig(str(exc)) from None


def moe_layer_pattern(config: dict[str, Any]) -> list[int]:
    """1 for each MoE decoder layer, 0 for each dense one, in global layer order (megatron's
    ``moe_layer_freq`` list)."""
    moe = set(model_geometry(config).moe_layers)
    return [int(i in moe) for i in range(int(config["num_hidden_layers"]))]


def check_supported(config: dict[str, Any]) -> None:
    """Refuse checkpoints whose features the mapping does not reproduce, naming the key."""
    model_type = config.get("model_type")
    if model_type not in _KEYS:
        raise UnsupportedConfig(
            f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
            + (
                " (DeepSeek's multi-head latent attention does not build in megatron-core "
                "0.16.1 without TransformerEngine; see docs/trainer.md)"
                if model_type in ("deepseek_v2", "deepseek_v3")
                else ""
            )
        )
    unknown = sorted(set(config) - _KEYS[model_type])
    if unknown:
        raise UnsupportedConfig(
            f"config.json key(s) {unknown} of model_type {model_type!r} are not understood by "
            "the megatron mapping; refusing rather than training a different model"
        )
    if config.get("use_sliding_window") or (
        model_type == "mixtral" and config.get("sliding_window") is not None
    ):
        raise UnsupportedConfig("sliding_window: sliding-window attention is not mapped")
    if any(t != "full_attention" for t in config.get("layer_types") or []):
        raise UnsupportedConfig("layer_types: only full_attention layers are mapped to megatron")
    if model_type == "qwen3_moe" and config.get("attention_bias"):
        raise UnsupportedConfig("attention_bias=True is not mapped to megatron for qwen3_moe")
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedConfig(f"hidden_act {config['hidden_act']!r}; only silu is mapped")
    if config.get("router_jitter_noise"):
        raise UnsupportedConfig("router_jitter_noise: the engines route without jitter")
    if config.get("num_nextn_predict_layers"):
        raise UnsupportedConfig(
            "num_nextn_predict_layers: multi-token-prediction layers are not mapped to megatron"
        )
    rope_theta(config)  # refuses rope scaling and unknown rope parameters
    if model_type != "glm4_moe" and _partial_rotary(config) != 1.0:
        raise UnsupportedConfig(f"partial_rotary_factor is not mapped for {model_type}")
    if model_type == "glm4_moe":
        _check_group_routing(config)


def _check_group_routing(config: dict[str, Any]) -> None:
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


@dataclass(frozen=True)
class GPTModelArgs:
    """The ``GPTModel`` constructor arguments that come from the checkpoint, not the config."""

    vocab_size: int
    max_sequence_length: int
    rotary_base: float
    rotary_percent: float  # the share of each head that is rotated (GLM-4.5: 0.5)
    share_embeddings_and_output_weights: bool

    def as_kwargs(self) -> dict[str, Any]:
        return {
            "vocab_size": self.vocab_size,
            "max_sequence_length": self.max_sequence_length,
            "position_embedding_type": "rope",
            "rotary_base": self.rotary_base,
            "rotary_percent": self.rotary_percent,
            "share_embeddings_and_output_weights": self.share_embeddings_and_output_weights,
        }


def gpt_model_args(config: dict[str, Any]) -> GPTModelArgs:
    return GPTModelArgs(
        vocab_size=int(config["vocab_size"]),
        max_sequence_length=int(config.get("max_position_embeddings") or 4096),
        rotary_base=rope_theta(config),
        rotary_percent=_partial_rotary(config),
        share_embeddings_and_output_weights=bool(config.get("tie_word_embeddings", False)),
    )


def transformer_config(
    config: dict[str, Any],
    *,
    routing_replay: bool,
    params_dtype: torch.dtype = torch.float32,
    **overrides: Any,
):
    """Build megatron's ``TransformerConfig`` for a checkpoint of a supported family.

    Args:
        config: The parsed ``config.json``.
        routing_replay: Sets ``moe_enable_routing_replay`` (one ``RouterReplay`` per router).
        params_dtype: Parameter dtype (float32 for the parity checks).
        **overrides: Further ``TransformerConfig`` fields (parallel sizes, recompute, aux loss).

    Returns:
        A ``megatron.core.transformer.TransformerConfig``.
    """
    from megatron.core.transformer import TransformerConfig

    check_supported(config)
    heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    fields: dict[str, Any] = dict(
        num_layers=int(config["num_hidden_layers"]),
        hidden_size=hidden,
        num_attention_heads=heads,
        num_query_groups=int(config.get("num_key_value_heads") or heads),
        kv_channels=int(config.get("head_dim") or hidden // heads),
        ffn_hidden_size=int(config["intermediate_size"]),
        normalization="RMSNorm",
        layernorm_epsilon=float(config.get("rms_norm_eps", 1e-6)),
        gated_linear_unit=True,
        activation_func=F.silu,
        # Biases on the MLPs and the output projection: none in any family (megatron's expert
        # bias path also needs add_bias_linear=False on the CPU).
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=float(config.get("attention_dropout") or 0.0),
        # Fusions are CUDA kernels or change numerics; parity needs the plain paths.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        rotary_interleaved=False,
        params_dtype=params_dtype,
        # MoE.
        num_moe_experts=num_experts(config),
        moe_layer_freq=moe_layer_pattern(config),
        moe_router_topk=int(config["num_experts_per_tok"]),
        moe_router_load_balancing_type="none",
        moe_token_dispatcher_type="allgather",
        moe_enable_routing_replay=routing_replay,
    )
    fields.update(family_fields(config))
    fields.update(overrides)
    return TransformerConfig(**fields)


def family_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The ``TransformerConfig`` fields particular to this checkpoint's family (qk-norm, qkv
    bias, shared experts, score function, expert bias, group routing, scaling, rotary share);
    the weight mapping reads which tensors exist from the same fields."""
    check_supported(config)
    return _FAMILY_FIELDS[config["model_type"]](config)


def _qwen3_moe(config: dict[str, Any]) -> dict[str, Any]:
    return dict(
        qk_layernorm=True,
        add_qkv_bias=False,
        moe_ffn_hidden_size=int(config["moe_intermediate_size"]),
        moe_router_score_function="softmax",
        # norm_topk_prob: softmax over the top-k logits (= renormalised top-k probabilities);
        # without it, softmax over all experts first.
        moe_router_pre_softmax=not bool(config.get("norm_topk_prob", False)),
    )


def _qwen2_moe(config: dict[str, Any]) -> dict[str, Any]:
    fields = _qwen3_moe(config)
    fields.update(qk_layernorm=False, add_qkv_bias=bool(config.get("qkv_bias", True)))
    shared = int(config.get("shared_expert_intermediate_size") or 0)
    if shared:
        # One shared expert, its output scaled by sigmoid(x @ shared_expert_gate).
        fields.update(moe_shared_expert_intermediate_size=shared, moe_shared_expert_gate=True)
    return fields


def _mixtral(config: dict[str, Any]) -> dict[str, Any]:
    return dict(
        qk_layernorm=False,
        add_qkv_bias=False,
        # Mixtral's experts are intermediate_size wide; it has no dense layer.
        moe_ffn_hidden_size=int(config["intermediate_size"]),
        moe_router_score_function="softmax",
        moe_router_pre_softmax=False,  # softmax over the top-k logits
    )


def _glm4_moe(config: dict[str, Any]) -> dict[str, Any]:
    """GLM-4.5: DeepSeek-V3's router with ordinary attention."""
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


def _partial_rotary(config: dict[str, Any]) -> float:
    params = config.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    return 1.0 if factor is None else float(factor)


# model_type -> the TransformerConfig fields of that family.
_FAMILY_FIELDS = {
    "qwen3_moe": _qwen3_moe,
    "qwen2_moe": _qwen2_moe,
    "mixtral": _mixtral,
    "glm4_moe": _glm4_moe,
}
