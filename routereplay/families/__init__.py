"""The model families, one module each, gathered in one table.

Adding a family: write its module (a ``Family``, its geometry rule included; see
``base.py``) and list it below.
"""

from __future__ import annotations

from typing import Any

from routereplay.families import (
    deepseek_v2,
    deepseek_v3,
    glm4_moe,
    gpt_oss,
    mixtral,
    qwen2_moe,
    qwen3_moe,
)
from routereplay.families.base import Family, UnsupportedConfig

# The families with an embedded tiny model (tests, the main job's --model-family).
FAMILIES: dict[str, Family] = {
    family.model_type: family
    for family in (
        qwen3_moe.FAMILY,
        qwen2_moe.FAMILY,
        mixtral.FAMILY,
        glm4_moe.FAMILY,
        gpt_oss.FAMILY,
        deepseek_v3.FAMILY,
        deepseek_v2.FAMILY,
    )
}
# Architectures served under another model_type (no tiny model of their own: transformers
# 5.17 has no config class for them).
ALIASES: dict[str, Family] = {"kimi_k2": deepseek_v3.KIMI_K2}
SUPPORTED_MODEL_TYPES = (*FAMILIES, *ALIASES)
DEFAULT_FAMILY = "qwen3_moe"


def family_of(config: dict[str, Any]) -> Family:
    """The ``Family`` of a parsed ``config.json``.

    Raises:
        UnsupportedConfig: Its ``model_type`` has no family module.
    """
    return family_named(config.get("model_type"))


def family_named(model_type: str | None) -> Family:
    """The ``Family`` of a ``model_type``, aliases included.

    Raises:
        UnsupportedConfig: It has no family module.
    """
    family = FAMILIES.get(model_type) or ALIASES.get(model_type)  # type: ignore[arg-type]
    if family is None:
        raise UnsupportedConfig(
            f"model_type {model_type!r} is not supported; supported: {SUPPORTED_MODEL_TYPES}"
        )
    return family
