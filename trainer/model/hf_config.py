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

from routereplay.domain.record import Geometry
from routereplay.families import Family, family_of
from routereplay.families.base import Rope, UnsupportedConfig


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    """The parsed ``config.json`` of a local Hugging Face checkpoint folder."""
    return json.loads((Path(model_dir) / "config.json").read_text())


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


@dataclass(frozen=True)
class CheckpointConfig:
    """A checkpoint's ``config.json``, checked once against its family (``check_config``):
    what the megatron mapping (``transformer_config``, ``model_args``) and the weight
    tables (``hf_weights``) take, so that none of them parses or checks it again.

    Attributes:
        raw: The parsed ``config.json``.
        family: Its family (``routereplay.families``).
        fields: The ``TransformerConfig`` fields particular to the family; the weight tables
            read from the same fields which tensors exist.
        geometry: The routing geometry in the record's terms (global MoE layer numbers, no
            model id), by the rule the rollout server applies.
        rope: The rotary embedding (base, rotated share, YaRN's attributes).
        model_args: The ``GPTModel`` arguments it sets.
    """

    raw: dict[str, Any]
    family: Family
    fields: dict[str, Any]
    geometry: Geometry
    rope: Rope
    model_args: GPTModelArgs

    @property
    def moe_pattern(self) -> list[int]:
        """1 for each MoE decoder layer, 0 for each dense one, in global layer order
        (megatron's ``moe_layer_freq`` list)."""
        moe = set(self.geometry.moe_layers)
        return [int(i in moe) for i in range(int(self.raw["num_hidden_layers"]))]

    @property
    def mtp_layers(self) -> int:
        """The multi-token-prediction layers (``model.layers.{num_hidden_layers + i}``), which
        the trainer's model leaves out (``build.megatron_config``)."""
        return _mtp_layers(self.raw)


def read_checkpoint_config(model_dir: str | Path) -> CheckpointConfig:
    """The checked ``config.json`` of a local Hugging Face checkpoint folder."""
    return check_config(read_hf_config(model_dir))


def check_config(config: dict[str, Any]) -> CheckpointConfig:
    """Refuse checkpoints whose features the mapping does not reproduce, naming the key, and
    derive once what the mapping and the weight tables read.

    Raises:
        UnsupportedConfig: A key or setting the mapping does not reproduce.
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
    if _mtp_layers(config) and not family.mtp_layers:
        raise UnsupportedConfig(
            "num_nextn_predict_layers: multi-token-prediction layers are not mapped to megatron"
        )
    family.refuse(config)
    rope = family.rope(config)
    try:
        geometry = family.geometry(config)
    except ValueError as exc:  # a key missing, or no MoE layer
        raise UnsupportedConfig(str(exc)) from None
    fields = family.megatron_fields(config)
    return CheckpointConfig(
        raw=config,
        family=family,
        fields=fields,
        geometry=geometry,
        rope=rope,
        model_args=_model_args(config, fields, rope),
    )


def _model_args(config: dict[str, Any], fields: dict[str, Any], rope: Rope) -> GPTModelArgs:
    # Latent attention rotates inside MLASelfAttention (its own YaRN): GPTModel builds no
    # rotary for it with "rope", and one MLA would refuse with "yarn".
    yarn = rope.yarn is not None and not fields.get("multi_latent_attention")
    return GPTModelArgs(
        vocab_size=int(config["vocab_size"]),
        max_sequence_length=int(config.get("max_position_embeddings") or 4096),
        rotary_base=rope.theta,
        rotary_percent=rope.percent,
        share_embeddings_and_output_weights=bool(config.get("tie_word_embeddings", False)),
        position_embedding_type="yarn" if yarn else "rope",
    )


def _mtp_layers(config: dict[str, Any]) -> int:
    return int(config.get("num_nextn_predict_layers") or 0)


def transformer_config(
    checkpoint: CheckpointConfig,
    *,
    routing_replay: bool,
    params_dtype: torch.dtype = torch.float32,
    **overrides: Any,
):
    """Build megatron's ``TransformerConfig`` for a checkpoint of a supported family.

    Args:
        checkpoint: The checked ``config.json`` (``check_config``).
        routing_replay: Sets ``moe_enable_routing_replay`` (one ``RouterReplay`` per router).
        params_dtype: Parameter dtype (float32 for the parity checks).
        **overrides: Further ``TransformerConfig`` fields (parallel sizes, recompute, aux loss).

    Returns:
        A ``megatron.core.transformer.TransformerConfig`` (its ``MLATransformerConfig``
        subclass for latent attention).
    """
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_config import MLATransformerConfig

    config = checkpoint.raw
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
        activation_func=_activation(checkpoint.family.activation),
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
        num_moe_experts=checkpoint.geometry.num_experts,
        moe_layer_freq=checkpoint.moe_pattern,
        moe_router_topk=int(config["num_experts_per_tok"]),
        moe_router_load_balancing_type="none",
        moe_token_dispatcher_type="allgather",
        moe_enable_routing_replay=routing_replay,
    )
    fields.update(checkpoint.fields)
    fields.update(overrides)
    if fields.get("multi_latent_attention"):
        # MLA's own YaRN fields come with the family's (mla_fields).
        return MLATransformerConfig(**fields)
    transformer = TransformerConfig(**fields)
    for name, value in (checkpoint.rope.yarn or {}).items():
        setattr(transformer, name, value)
    return transformer


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    """gpt-oss's SwiGLU gate, ``x * sigmoid(1.702 x)``, in eager torch as transformers runs it.

    Not megatron's ``quick_gelu``: it is ``torch.compile``'d, and on the CPU inductor's on-disk
    cache (one per user by default) is not keyed by the vector width that
    ``ATEN_CPU_CAPABILITY`` selects. A kernel generated for AVX-512 (16 floats a step) and
    compiled again for AVX2 (8 a step) leaves half its outputs unwritten (NaN losses); the
    reverse writes past its buffer (heap corruption). tests/trainer/model/test_gpt_oss.py shows it.
    """
    return x * torch.sigmoid(1.702 * x)


def _activation(name: str):
    if name == "silu":
        return F.silu
    if name == "quick_gelu":  # megatron's fused paths compare with its own; they are off
        return quick_gelu
    raise UnsupportedConfig(f"activation {name!r} is not mapped")
