"""Fixtures shared by all tests: real redis-server processes on free loopback ports."""

from __future__ import annotations

import pytest

from routereplay.dev.redis_nodes import RedisProcess, start_cluster
from routereplay.families import DEFAULT_FAMILY, FAMILIES


@pytest.fixture(scope="session")
def redis_node():
    node = RedisProcess().start()
    yield node
    node.stop()


@pytest.fixture(scope="session")
def redis_cluster_nodes():
    nodes = start_cluster(3)
    yield nodes
    for node in nodes:
        node.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The embedded tiny Qwen3-MoE (dense layer 0, MoE layers 1-3), built once per session."""
    pytest.importorskip("transformers")
    from routereplay.dev.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-qwen3-moe"), seed=0)


# Every family but the default (whose tests use tiny_model_dir).
OTHER_FAMILIES = tuple(family for family in FAMILIES if family != DEFAULT_FAMILY)


@pytest.fixture(scope="session")
def family_model_dir(tmp_path_factory):
    """``family_model_dir(family)``: the embedded tiny model of that family, built once per
    session on first use (``qwen3_moe`` is ``tiny_model_dir``'s model)."""
    pytest.importorskip("transformers")
    from routereplay.dev.tiny_model import build_tiny_model

    built = {}

    def get(family: str):
        if family not in built:
            built[family] = build_tiny_model(
                tmp_path_factory.mktemp(f"tiny-{family}"), seed=0, family=family
            )
        return built[family]

    return get
