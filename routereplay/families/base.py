"""What a model family is made of: the ``Family`` record and the rules every family shares.

A family is one Hugging Face ``model_type``. Its module (one per family, beside this one) holds
everything the project knows about it:

- which decoder layers are MoE layers and how many routed experts they have (``moe_layers``:
  the geometry rule, which the torch-free rollout server applies too through
  ``routereplay.families.model_geometry``);
- the ``config.json`` keys the megatron mapping understands (any other key is refused, naming
  it, since an unknown key may change the maths) and the settings it refuses;
- the megatron-core ``TransformerConfig`` fields particular to the family;
- the Hugging Face names of its MoE tensors;
- the config and sizes of its embedded tiny model.

Nothing here imports torch, transformers or megatron: the trainer turns the fields into a
``TransformerConfig``, and tiny-model configs import transformers only when called.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from routereplay.domain.record import Geometry


class UnsupportedConfig(ValueError):
    """The checkpoint or a trainer setting cannot be run (or replayed) faithfully."""


@dataclass(frozen=True)
class MoESize:
    """Sizes of a generated tiny MoE model.

    The defaults are the tiny test model; ``routereplay.dev.tiny_model.BENCH_SIZE`` is large
    enough for timings to mean something on a CPU.
    """

    hidden_size: int = 128
    intermediate_size: int = 256
    moe_intermediate_size: int = 64
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32  # vLLM's CPU attention kernel needs head_dim >= 32
    num_experts: int = 8
    num_experts_per_tok: int = 2


TINY_SIZE = MoESize()
# The tiny models' vocabulary (their tokenizer is trained to at most this many entries).
VOCAB_SIZE = 512

DENSE_PROJ = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class WeightNames:
    """Hugging Face names of a family's MoE tensors, relative to ``model.layers.L.``."""

    moe: str  # the MoE block
    expert_proj: tuple[str, str, str] = DENSE_PROJ  # an expert's gate, up and down projections
    shared: str | None = None  # the shared expert MLP
    shared_gate: str | None = None  # its sigmoid gate
    router: str = "gate"  # the router, under the MoE block
    # Experts stored as [experts, ...] tensors (``experts.gate_up_proj`` with gate and up
    # columns interleaved, ``experts.down_proj``, each with a bias: gpt-oss) instead of one by one.
    fused_experts: bool = False


# Keys every family shares, which either feed the mapping or do not change the maths (token
# ids, bookkeeping, inference-only switches, the aux-loss coefficient the trainer's own
# configuration replaces).
COMMON_KEYS = frozenset(
    {
        "architectures",
        "model_type",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "use_cache",
        "initializer_range",
        "output_router_logits",
        "router_aux_loss_coef",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "max_position_embeddings",
        "rms_norm_eps",
        "tie_word_embeddings",
        "rope_parameters",
        "rope_theta",
        "rope_scaling",
        "attention_dropout",
        "hidden_act",
        "num_experts_per_tok",
    }
)


def _no_refusal(config: dict[str, Any]) -> None:
    del config


def first_of(config: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """First present, non-None value among ``keys`` of a ``config.json`` (``default`` when
    none is and it is given).

    Raises:
        ValueError: None of ``keys`` is set and there is no default.
    """
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    if default is not None:
        return default
    raise ValueError(f"config.json lacks all of {keys}")


def every_layer_moe(config: dict[str, Any], *expert_keys: str) -> tuple[list[int], int]:
    """The rule of families whose every decoder layer is an MoE layer (Mixtral, gpt-oss)."""
    return list(range(config["num_hidden_layers"])), int(first_of(config, *expert_keys))


@dataclass(frozen=True)
class Family:
    """Everything the trainer and the tiny-model builder know about one ``model_type``.

    Attributes:
        model_type: The Hugging Face ``model_type`` of ``config.json``.
        moe_layers: ``config.json`` -> (the global numbers of its MoE decoder layers, the
            routed experts per layer), the rules of transformers' and vLLM's model code;
            multi-token-prediction layers beyond ``num_hidden_layers`` are never among them.
            Torch-free: the rollout server reads it too.
        config_keys: Every ``config.json`` key the megatron mapping understands.
        megatron_fields: ``config.json`` -> the ``TransformerConfig`` fields particular to
            the family (qk-norm, qkv bias, shared experts, score function, expert bias, group
            routing, scaling, expert width); the weight mapping reads which tensors exist from
            the same fields.
        weights: The Hugging Face names of its MoE tensors.
        tiny_config: (sizes, token ids) -> the ``transformers`` config of a tiny model.
        tiny_size: The sizes of its embedded tiny test model.
        refuse: Raises ``UnsupportedConfig`` for a setting of this family that megatron would
            compute differently (after the checks every family shares).
        partial_rotary: Whether ``partial_rotary_factor`` is mapped (``rotary_percent``).
        activation: The experts' activation, by megatron name: ``silu`` (SwiGLU) or
            ``quick_gelu`` (gpt-oss's clamped SwiGLU, with the clamp and offset fields).
        rope_types: The ``rope_type`` values mapped (``yarn``: megatron's YaRN rotary).
        sliding_window: Whether ``layer_types``' sliding-window layers are mapped (the
            family's ``refuse`` checks their pattern).
        tiny_init: Spreads a freshly built tiny model's family-specific weights (under
            ``torch.no_grad``, seeded by the builder); None: the builder's defaults only.
        rope_keys: Further ``rope_parameters`` keys of YaRN the family maps (DeepSeek's
            ``mscale`` and ``mscale_all_dim``).
        mtp_layers: Whether the checkpoint's multi-token-prediction layers
            (``num_nextn_predict_layers``, stored as ``model.layers.{num_hidden_layers + i}``)
            can be left out of the trainer's model (see ``trainer/model/build.py``).
    """

    model_type: str
    moe_layers: Callable[[dict[str, Any]], tuple[list[int], int]]
    config_keys: frozenset[str]
    megatron_fields: Callable[[dict[str, Any]], dict[str, Any]]
    weights: WeightNames
    tiny_config: Callable[[MoESize, dict[str, int]], Any]
    tiny_size: MoESize = TINY_SIZE
    refuse: Callable[[dict[str, Any]], None] = _no_refusal
    partial_rotary: bool = False
    activation: str = "silu"
    rope_types: frozenset[str] = frozenset({"default"})
    sliding_window: bool = False
    tiny_init: Callable[[Any], None] | None = None
    rope_keys: frozenset[str] = frozenset()
    mtp_layers: bool = False

    def geometry(self, config: dict[str, Any], model_id: str = "") -> Geometry:
        """The routing geometry of a ``config.json`` of this family, in the record's terms
        (global MoE layer numbers; ``model_id`` stored in it).

        Raises:
            ValueError: Missing keys, or no MoE layer.
        """
        layers, num_experts = self.moe_layers(config)
        if not layers:
            raise ValueError(f"{model_id or self.model_type}: config describes no MoE layer")
        geometry = Geometry(
            moe_layers=tuple(layers),
            topk=int(first_of(config, "num_experts_per_tok")),
            num_experts=num_experts,
            model_id=model_id,
        )
        geometry.validate()
        return geometry

    def rope(self, config: dict[str, Any]) -> Rope:
        """The checkpoint's rotary embedding as the megatron mapping reads it; refuses rope
        types, keys and a partial rotation the family does not map."""
        params = rope_parameters(config)
        rope_type = params["rope_type"]
        allowed = {"rope_type", "rope_theta", "partial_rotary_factor"}
        if rope_type == "yarn":
            allowed |= _YARN_KEYS | self.rope_keys
        unknown = set(params) - allowed
        if unknown:
            raise UnsupportedConfig(f"rope_parameters keys {sorted(unknown)} are not mapped")
        if rope_type not in self.rope_types:
            raise UnsupportedConfig(f"rope scaling {rope_type!r} is not mapped to megatron yet")
        if params.get("rope_theta") is None:
            raise UnsupportedConfig("config.json lacks rope_theta")
        factor = params.get("partial_rotary_factor", config.get("partial_rotary_factor"))
        percent = 1.0 if factor is None else float(factor)
        if not self.partial_rotary and percent != 1.0:
            raise UnsupportedConfig(f"partial_rotary_factor is not mapped for {self.model_type}")
        return Rope(float(params["rope_theta"]), percent, _yarn(params))


# YaRN's rope parameters, as transformers names them.
_YARN_KEYS = {"factor", "beta_fast", "beta_slow", "truncate", "original_max_position_embeddings"}


@dataclass(frozen=True)
class Rope:
    """A checkpoint's rotary embedding in megatron's terms.

    Attributes:
        theta: The rotary base.
        percent: The share of each head that is rotated (GLM-4.5: 0.5).
        yarn: The ``yarn_*`` attributes megatron's YaRN rotary reads from the
            ``TransformerConfig``; None without YaRN.
    """

    theta: float
    percent: float
    yarn: dict[str, Any] | None


def _yarn(params: dict[str, Any]) -> dict[str, Any] | None:
    """``GPTModel(position_embedding_type="yarn")`` reads these with ``getattr`` from the
    config, but megatron-core 0.16.1 declares them on ``MLATransformerConfig`` only: a plain
    ``TransformerConfig`` raises ``AttributeError: yarn_rotary_scaling_factor``. The
    attention applies YaRN's softmax scale (``0.1 ln(factor) + 1``, squared) itself."""
    if params["rope_type"] != "yarn":
        return None
    for key in ("factor", "original_max_position_embeddings"):
        if key not in params:
            raise UnsupportedConfig(f"rope_parameters: YaRN without {key}")
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


def rope_parameters(config: dict[str, Any]) -> dict[str, Any]:
    """The rope settings of a ``config.json`` in transformers 5's terms (``rope_parameters``:
    ``rope_type``, ``rope_theta``, scaling keys), also from a transformers 4 config
    (top-level ``rope_theta`` and a ``rope_scaling`` dict whose ``type`` names the kind, as
    DeepSeek-V3's and Kimi-K2's own ``config.json`` have them)."""
    params = dict(config.get("rope_parameters") or {})
    legacy = dict(config.get("rope_scaling") or {})
    if "type" in legacy:
        legacy.setdefault("rope_type", legacy.pop("type"))
    params = {**legacy, **params}
    if params.get("rope_theta") is None and config.get("rope_theta") is not None:
        params["rope_theta"] = config["rope_theta"]
    params.setdefault("rope_type", "default")
    return params


def tiny_common(size: MoESize, token_ids: dict[str, int]) -> dict[str, Any]:
    """The ``transformers`` config arguments every tiny family model shares."""
    return dict(
        vocab_size=VOCAB_SIZE,
        hidden_size=size.hidden_size,
        num_hidden_layers=size.num_hidden_layers,
        num_attention_heads=size.num_attention_heads,
        num_key_value_heads=size.num_key_value_heads,
        head_dim=size.head_dim,
        num_experts_per_tok=size.num_experts_per_tok,
        max_position_embeddings=2048,
        tie_word_embeddings=False,
        dtype="float32",
        **token_ids,
    )
