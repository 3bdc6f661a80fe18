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


# YaRN's rope parameters, as transformers names them.
_YARN_KEYS = {"factor", "beta_fast", "beta_slow", "truncate", "original_max_position_embeddings"}


def rope_theta(config: dict[str, Any]) -> float:
    """The rotary base, from ``rope_parameters`` (transformers 5) or the top level (4.x);
    refuses rope types and keys the family does not map."""
    family = family_of(config)
    params = rope_parameters(config)
    rope_type = params["rope_type"]
    allowed = {"rope_type", "rope_theta", "partial_rotary_factor"}
    if rope_type == "yarn":
        allowed |= _YARN_KEYS | family.rope_keys
    unknown = set(params) - allowed
    if unknown:
        raise UnsupportedConfig(f"rope_parameters keys {sorted(unknown)} are not mapped")
    if rope_type not in family.rope_types:
        raise UnsupportedConfig(f"rope scaling {rope_type!r} is not mapped to megatron yet")
    return float(_get(params, "rope_theta"))


def yarn_attributes(config: dict[str, Any]) -> dict[str, Any] | None:
    """The ``yarn_*`` attributes megatron's YaRN rotary reads from the ``TransformerConfig``
    (None without YaRN).

    ``GPTModel(position_embedding_type="yarn")`` reads them with ``getattr`` from the config,
    but megatron-core 0.16.1 declares them on ``MLATransformerConfig`` only: a plain
    ``TransformerConfig`` raises ``AttributeError: yarn_rotary_scaling_factor``. The
    attention applies YaRN's softmax scale (``0.1 ln(factor) + 1``, squared) itself.
    """
    params = rope_parameters(config)
    if params["rope_type"] != "yarn":
        return None
    return dict(
        yarn_rotary_scaling_factor=float(params["factor"]),
        yarn_original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        yarn_beta_fast=float(params.get("beta_fast", 32.0)),
        yarn_beta_slow=float(params.get("beta_slow", 1.0)),
        # transformers' default attention factor: mscale 1 over mscale_all_dim 0.
        yarn_mscale=1.0,
        yarn_mscale_all_dim=0.0,
        # transformers' truncate (default True) rounds the correction range to integers.
        yarn_correction_range_round_to_int=bool(params.get("truncate", True)),
    )


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
    if not family.sliding_window and any(
        t != "full_attention" for t in config.get("layer_types") or []
    ):
        raise UnsupportedConfig("layer_types: only full_attention layers are mapped to megatron")
    # gpt-oss's config says silu too: its experts' clamped SwiGLU is its family's activation.
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedConfig(f"hidden_act {config['hidden_act']!r}; only silu is mapped")
    if config.get("router_jitter_noise"):
        raise UnsupportedConfig("router_jitter_noise: the engines route without jitter")
    if mtp_layers(config) and not family.mtp_layers:
        raise UnsupportedConfig(
            "num_nextn_predict_layers: multi-token-prediction layers are not mapped to megatron"
        )
    rope_theta(config)  # refuses rope types and keys the family does not map
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
    position_embedding_type: str = "rope"  # "yarn": YaRN-scaled rope (gpt-oss)

    def as_kwargs(self) -> dict[str, Any]:
        return {
            "vocab_size": self.vocab_size,
            "max_sequence_length": self.max_sequence_length,
            "position_embedding_type": self.position_embedding_type,
            "rotary_base": self.rotary_base,
            "rotary_percent": self.rotary_percent,
            "share_embeddings_and_output_weights": self.share_embeddings_and_output_weights,
        }


def gpt_model_args(config: dict[str, Any]) -> GPTModelArgs:
    # Latent attention rotates inside MLASelfAttention (its own YaRN): GPTModel builds no
    # rotary for it with "rope", and one MLA would refuse with "yarn".
    yarn = yarn_attributes(config) is not None and not family_fields(config).get(
        "multi_latent_attention"
    )
    return GPTModelArgs(
        vocab_size=int(config["vocab_size"]),
        max_sequence_length=int(config.get("max_position_embeddings") or 4096),
        rotary_base=rope_theta(config),
        rotary_percent=_partial_rotary(config),
        share_embeddings_and_output_weights=bool(config.get("tie_word_embeddings", False)),
        position_embedding_type="yarn" if yarn else "rope",
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
        activation_func=_activation(check_supported(config).activation),
        # Biases on the MLPs, router and output projection: only gpt-oss has them (its family
        # sets this; megatron's expert bias path needs megatron_fixes' out-of-place add).
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
        # MLA's own YaRN fields come with the family's (mla_fields).
        return MLATransformerConfig(**fields)
    transformer = TransformerConfig(**fields)
    for name, value in (yarn_attributes(config) or {}).items():
        setattr(transformer, name, value)
    return transformer


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """gpt-oss's SwiGLU gate, ``x * sigmoid(1.702 x)``, in eager torch as transformers runs it.

    Not megatron's ``quick_gelu``: it is ``torch.compile``'d, and on the CPU inductor's on-disk
    cache (one per user by default) is not keyed by the vector width that
    ``ATEN_CPU_CAPABILITY`` selects. A kernel generated for AVX-512 (16 floats a step) and
    compiled again for AVX2 (8 a step) leaves half its outputs unwritten (NaN losses); the
    reverse writes past its buffer (heap corruption). tests/trainer/test_gpt_oss.py shows it.
    """
    return x * torch.sigmoid(1.702 * x)


def _activation(name: str):
    if name == "silu":
        return F.silu
    if name == "quick_gelu":  # megatron's fused paths compare with its own; they are off
        return quick_gelu
    raise UnsupportedConfig(f"activation {name!r} is not mapped")


def family_fields(config: dict[str, Any]) -> dict[str, Any]:
    """The ``TransformerConfig`` fields particular to this checkpoint's family (its module in
    ``routereplay.families``); the weight mapping reads which tensors exist from the same
    fields."""
    return check_supported(config).megatron_fields(config)


def _partial_rotary(config: dict[str, Any]) -> float:
    params = config.get("rope_parameters") or {}
    factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    return 1.0 if factor is None else float(factor)
