"""A Hugging Face Qwen3-MoE ``config.json`` as megatron-core's ``TransformerConfig``.

Every field below was needed for logit parity with transformers on the CPU in float32 (see
docs/trainer.md): a wrong qkv layout, ``rotary_interleaved``, ``qk_layernorm``, rotary base,
fc1 order, ``moe_router_pre_softmax``, norm epsilon or ``kv_channels`` each broke it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from routereplay.model_geometry import geometry_from_config
from routereplay.record import Geometry

SUPPORTED_MODEL_TYPES = ("qwen3_moe",)


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
    # transformers 5.x moved rope_theta into rope_parameters.
    params = config.get("rope_parameters") or {}
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
    """Refuse checkpoints whose features the mapping does not reproduce."""
    model_type = config.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedConfig(
            f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
        )
    if config.get("use_sliding_window"):
        raise UnsupportedConfig("sliding-window attention is not mapped to megatron yet")
    if config.get("attention_bias"):
        raise UnsupportedConfig("attention_bias=True is not mapped to megatron yet")
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedConfig(f"hidden_act {config['hidden_act']!r}; only silu is mapped")


@dataclass(frozen=True)
class GPTModelArgs:
    """The ``GPTModel`` constructor arguments that come from the checkpoint, not the config."""

    vocab_size: int
    max_sequence_length: int
    rotary_base: float
    share_embeddings_and_output_weights: bool

    def as_kwargs(self) -> dict[str, Any]:
        return {
            "vocab_size": self.vocab_size,
            "max_sequence_length": self.max_sequence_length,
            "position_embedding_type": "rope",
            "rotary_base": self.rotary_base,
            "share_embeddings_and_output_weights": self.share_embeddings_and_output_weights,
        }


def gpt_model_args(config: dict[str, Any]) -> GPTModelArgs:
    return GPTModelArgs(
        vocab_size=int(config["vocab_size"]),
        max_sequence_length=int(config.get("max_position_embeddings") or 4096),
        rotary_base=rope_theta(config),
        share_embeddings_and_output_weights=bool(config.get("tie_word_embeddings", False)),
    )


def transformer_config(
    config: dict[str, Any],
    *,
    routing_replay: bool,
    params_dtype: torch.dtype = torch.float32,
    **overrides: Any,
):
    """Build megatron's ``TransformerConfig`` for a Qwen3-MoE checkpoint.

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
        qk_layernorm=True,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
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
        moe_ffn_hidden_size=int(config["moe_intermediate_size"]),
        moe_router_topk=int(config["num_experts_per_tok"]),
        moe_router_score_function="softmax",
        # norm_topk_prob: softmax over the top-k logits (= renormalised top-k probabilities);
        # without it, softmax over all experts first.
        moe_router_pre_softmax=not bool(config.get("norm_topk_prob", False)),
        moe_router_load_balancing_type="none",
        moe_token_dispatcher_type="allgather",
        moe_enable_routing_replay=routing_replay,
    )
    fields.update(overrides)
    return TransformerConfig(**fields)
