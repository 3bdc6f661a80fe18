"""The model families, one module each, gathered in one table.

Adding a family: write its module (a ``Family``; see ``base.py``), list it below, and give
``routereplay.domain.model_geometry`` its geometry rule (which MoE layers route), the one piece
the torch-free rollout server needs too.
"""

from __future__ import annotations

from typing import Any

from routereplay.families import glm4_moe, gpt_oss, mixtral, qwen2_moe, qwen3_moe
from routereplay.families.base import Family, UnsupportedConfig

FAMILIES: dict[str, Family] = {
    family.model_type: family
    for family in (
        qwen3_moe.FAMILY,
        qwen2_moe.FAMILY,
        mixtral.FAMILY,
        glm4_moe.FAMILY,
        gpt_oss.FAMILY,
    )
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
DEFAULT_FAMILY = "qwen3_moe"


def family_of(config: dict[str, Any]) -> Family:
    """The ``Family`` of a parsed ``config.json``.

    Raises:
        UnsupportedConfig: Its ``model_type`` has no family module.
    """
    model_type = config.get("model_type")
    family = FAMILIES.get(model_type)  # type: ignore[arg-type]
    if family is None:
        raise UnsupportedConfig(
            f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
            + (
                " (DeepSeek's multi-head latent attention does not build in megatron-core "
                "0.16.1 without TransformerEngine; see docs/trainer.md)"
                if model_type in ("deepseek_v2", "deepseek_v3")
                else ""
            )
        )
    return family
