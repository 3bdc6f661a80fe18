"""What verl's two seams agree on: where the sample's id travels, which geometry records are
written and checked against, and where the route cache is."""

from __future__ import annotations

import os
from collections.abc import Mapping

from routereplay.families.model_geometry import MoEGeometry, load_geometry

ID_FIELD = "route_cache_id"
"""``TokenOutput.extra_fields`` key under which the rollout returns the sample's route cache id;
verl's V0 data path turns it into a ``non_tensor_batch`` column of the same name, its V1 path
keeps it in each sample's ``extra_fields`` dict."""

TARGET_ENV = "ROUTER_REPLAY_CACHE"

RAY_ROUTES_ENV = "ROUTER_REPLAY_RAY_ROUTES"
"""``refuse`` (default) or ``use``: what the trainer engine does with a batch that arrives with
verl's own ``routed_experts`` (through Ray: a disaggregated prefill/decode rollout, whose
replicas verl builds without the registry the plugin converts) while the route cache is on."""


def served_geometry(model_dir: str) -> MoEGeometry:
    """The geometry of the model in ``model_dir`` (its ``config.json``), named by the folder's
    name: what the rollout side writes and the trainer side checks records against."""
    return load_geometry(model_dir, os.path.basename(os.path.normpath(model_dir)))


def route_cache_target(custom: Mapping | None = None) -> str | None:
    """The route cache's ``host:port``: ``custom["route_cache"]`` (verl's
    ``actor_rollout_ref.rollout.custom``), else ``$ROUTER_REPLAY_CACHE``, else None."""
    return (custom or {}).get("route_cache") or os.environ.get(TARGET_ENV) or None
