"""A Hugging Face MoE ``config.json`` as megatron-core's ``TransformerConfig``, per family.

Every field below was needed for logit parity with transformers on the CPU in float32 (see
docs/trainer.md): a wrong qkv layout, ``rotary_interleaved``, ``qk_layernorm``, rotary base,
fc1 order, ``moe_router_pre_softmax``, norm epsilon or ``kv_channels`` each broke it.

What is particular to a family (its known keys, refusals and fields) lives in its module in
``routereplay.families``; this module applies the rules all families share. A checkpoint with
a key its family does not list is refused before anything is built, naming the key, since an
unknown key may change the model's maths.
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
from routereplay.families import Family, family_of
from routereplay.families.base import UnsupportedConfig, rope_parameters


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
    """The rotary base, from ``rope_parameters`` (transformers 5) or the top level (4.x)."""
    theta = rope_parameters(config).get("rope_theta")
    if theta is None:
        raise UnsupportedConfig("config.json lacks rope_theta")
    return float(theta)


def _refuse_rope_scaling(config: dict[str, Any]) -> None:
    """Families without ``rope_scaling``: plain rope only (and a partial rotary factor)."""
    params = rope_parameters(config)
    unknown = set(params) - {"rope_type", "rope_theta", "partial_rotary_factor"}
    rope_type = params["rope_type"]
    if rope_type != "default":
        raise UnsupportedConfig(f"rope scaling {rope_type!r} is not mapped to megatron yet")
    if unknown:
        raise UnsupportedConfig(f"rope_parameters keys {sorted(unknown)} are not mapped")


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


def check_supported(config: dict[str, Any]) -> Family:
    """Refuse checkpoints whose features the mapping does not reproduce, naming the key.

    Returns:
        The checkpoint's ``Family``.
    """
    family = family_of(config)
    unknown = sorted(set(config) - family.config_keys)
    if unknown:
        raise UnsupportedConfig(
            f"config.json key(s) {unknown} of model_type {family.model_type!r} are not "
            "understood by the megatron mapping; refusing rather than training a different model"
        )
    if config.get("use_sliding_window"):
        raise UnsupportedConfig("sliding_window: sliding-window attention is not mapped")
    if any(t != "full_attention" for t in config.get("layer_types") or []):
        raise UnsupportedConfig("layer_types: only full_attention layers are mapped to megatron")
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedConfig(f"hidden_act {config['hidden_act']!r}; only silu is mapped")
    if config.get("router_jitter_noise"):
        raise UnsupportedConfig("router_jitter_noise: the engines route without jitter")
    if mtp_layers(config) and not family.mtp_layers:
        raise UnsupportedConfig(
            "num_nextn_predict_layers: multi-token-prediction layers are not mapped to megatron"
        )
    rope_theta(config)
    if not family.rope_scaling:
        _refuse_rope_scaling(config)
    if not family.partial_rotary and _partial_rotary(config) != 1.0:
        raise UnsupportedConfig(f"partial_rotary_factor is not mapped for {family.model_type}")
    family.refuse(config)
    return family


def mtp_layers(config: dict[str, Any]) -> int:
    """The checkpoint's multi-token-prediction layers (``model.layers.{num_hidden_layers + i}``),
    which the trainer's model leaves out (``build.megatron_config``)."""
    return int(config.get("num_nextn_predict_layers") or 0)


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
        A ``megatron.core.transformer.TransformerConfig`` (its ``MLATransformerConfig``
        subclass for latent attention).
    """
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

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
    if fields.get("multi_latent_attention"):
        return MLATransformerConfig(**fields)
    return TransformerConfig(**fields)


def family_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The ``TransformerConfig`` fields particular to this checkpoint's family (its module in
    ``routereplay.families``); the weight mapping reads which tensors exist from the same
    fields."""
    return check_supported(config).megatron_fields(config)


def _partial_rotary(config: dict[str, Any]) -> float:
    params = config.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    return 1.0 if factor is None else float(factor)
