"""MoE geometry of a model: which global layers route, top-k, expert count.

Engines return one routing row per hidden layer, dense layers included. A
record keeps only the MoE layers, so the geometry names them by global layer
number (0-based index into the decoder stack). MTP / next-token-prediction
layers that sit beyond ``num_hidden_layers`` are never part of the geometry.

Which layers are MoE layers is each family's rule (``Family.moe_layers`` in
``routereplay.families``, torch-free), following the model code of Hugging Face
transformers and vLLM for each supported ``model_type``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from routereplay.domain.record import Geometry
from routereplay.families import family_of


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


def geometry_from_config(config: dict[str, Any], model_id: str) -> MoEGeometry:
    """Read the MoE geometry from a Hugging Face ``config.json`` dict.

    Args:
        config: The parsed ``config.json`` (or ``PretrainedConfig.to_dict()``).
        model_id: Identifier stored in the geometry.

    Returns:
        The model's ``MoEGeometry``.

    Raises:
        ValueError: Unknown ``model_type`` (``UnsupportedConfig``, naming the supported ones),
            missing keys, or no MoE layer.
    """
    geometry = family_of(config).geometry(config, model_id)
    return MoEGeometry(geometry, num_hidden_layers=int(config["num_hidden_layers"]))


def load_geometry(model_dir: str | Path, model_id: str | None = None) -> MoEGeometry:
    """Read ``model_dir/config.json`` and return its geometry.

    Args:
        model_dir: A local model folder holding ``config.json``.
        model_id: Identifier to store; defaults to ``str(model_dir)``.
    """
    path = Path(model_dir) / "config.json"
    config = json.loads(path.read_text())
    return geometry_from_config(config, model_id or str(model_dir))
