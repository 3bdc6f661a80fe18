"""MoE geometry of a model: which global layers route, top-k, expert count.

Engines return one routing row per hidden layer, dense layers included. A
record keeps only the MoE layers, so the geometry names them by global layer
number (0-based index into the decoder stack). MTP / next-token-prediction
layers that sit beyond ``num_hidden_layers`` are never part of the geometry.

The rules follow the model code of Hugging Face transformers and vLLM for
each supported ``model_type``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from routereplay.domain.record import Geometry


@dataclass(frozen=True)
class MoEGeometry:
    """A served model's routing shape: the stored geometry plus the engine's layer count.

    Attributes:
        record: What records store (``routereplay.domain.record.Geometry``): the global
            layer numbers of the MoE layers, top-k, expert count, model id.
        num_hidden_layers: Decoder layers (MTP layers excluded). Engines return
            one route column per decoder layer, dense layers included; this is
            the width of that raw capture before the dense columns are dropped.
    """

    record: Geometry
    num_hidden_layers: int


def _get(config: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """First present, non-None value among ``keys``."""
    for key in keys:
        if config.get(key) is not None:
            return config[key]
    if default is not None:
        return default
    raise ValueError(f"config.json lacks all of {keys}")


def _qwen_moe(config: dict[str, Any]) -> tuple[list[int], int]:
    # Qwen2-MoE / Qwen3-MoE: a layer is MoE unless listed in mlp_only_layers,
    # and only every decoder_sparse_step-th layer (1-based) is sparse.
    num_experts = int(_get(config, "num_experts", "num_local_experts"))
    dense = set(config.get("mlp_only_layers") or [])
    step = int(_get(config, "decoder_sparse_step", default=1))
    layers = [
        i
        for i in range(config["num_hidden_layers"])
        if i not in dense and num_experts > 0 and (i + 1) % step == 0
    ]
    return layers, num_experts


def _mixtral(config: dict[str, Any]) -> tuple[list[int], int]:
    # Mixtral: every decoder layer is MoE.
    num_experts = int(_get(config, "num_local_experts", "num_experts"))
    return list(range(config["num_hidden_layers"])), num_experts


def _gpt_oss(config: dict[str, Any]) -> tuple[list[int], int]:
    # gpt-oss: every decoder layer is MoE (windowed or not).
    return list(range(config["num_hidden_layers"])), int(_get(config, "num_local_experts"))


def _deepseek_v3(config: dict[str, Any]) -> tuple[list[int], int]:
    # DeepSeek-V2/V3 and GLM-4.5 (glm4_moe): the first first_k_dense_replace layers
    # are dense, then every moe_layer_freq-th layer is MoE (vLLM's rule; freq is 1
    # in V3 and absent from GLM-4.5).
    # MTP layers (num_nextn_predict_layers) come after num_hidden_layers.
    num_experts = int(_get(config, "n_routed_experts", "num_local_experts"))
    first_dense = int(_get(config, "first_k_dense_replace", default=0) or 0)
    freq = int(_get(config, "moe_layer_freq", default=1))
    layers = [i for i in range(config["num_hidden_layers"]) if i >= first_dense and i % freq == 0]
    return layers, num_experts


# model_type -> rule returning (moe layer numbers, number of routed experts).
_FAMILIES: dict[str, Callable[[dict[str, Any]], tuple[list[int], int]]] = {
    "qwen2_moe": _qwen_moe,
    "qwen3_moe": _qwen_moe,
    "mixtral": _mixtral,
    "deepseek_v2": _deepseek_v3,
    "deepseek_v3": _deepseek_v3,
    "kimi_k2": _deepseek_v3,  # Kimi-K2: DeepSeek-V3's architecture under its own name
    "glm4_moe": _deepseek_v3,
    "gpt_oss": _gpt_oss,
}

SUPPORTED_MODEL_TYPES: tuple[str, ...] = tuple(sorted(_FAMILIES))


def geometry_from_config(config: dict[str, Any], model_id: str) -> MoEGeometry:
    """Read the MoE geometry from a Hugging Face ``config.json`` dict.

    Args:
        config: The parsed ``config.json`` (or ``PretrainedConfig.to_dict()``).
        model_id: Identifier stored in the geometry.

    Returns:
        The model's ``MoEGeometry``.

    Raises:
        ValueError: Unknown ``model_type``, missing keys, or no MoE layer.
    """
    model_type = config.get("model_type")
    rule = _FAMILIES.get(model_type)  # type: ignore[arg-type]
    if rule is None:
        raise ValueError(
            f"unsupported model_type {model_type!r}; supported: " + ", ".join(SUPPORTED_MODEL_TYPES)
        )
    layers, num_experts = rule(config)
    if not layers:
        raise ValueError(f"{model_id}: config describes no MoE layer")
    record = Geometry(
        moe_layers=tuple(layers),
        topk=int(_get(config, "num_experts_per_tok")),
        num_experts=num_experts,
        model_id=model_id,
    )
    record.validate()
    return MoEGeometry(record, num_hidden_layers=int(config["num_hidden_layers"]))


def load_geometry(model_dir: str | Path, model_id: str | None = None) -> MoEGeometry:
    """Read ``model_dir/config.json`` and return its geometry.

    Args:
        model_dir: A local model folder holding ``config.json``.
        model_id: Identifier to store; defaults to ``str(model_dir)``.
    """
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text())
    return geometry_from_config(config, model_id or str(model_dir))
