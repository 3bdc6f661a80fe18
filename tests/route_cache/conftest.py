from __future__ import annotations

import uuid

import numpy as np
import pytest
import redis

from route_cache.config import Config
from route_cache.connection import connect
from route_cache.server import RouteCacheServer
from route_cache.store import RouteStore
from routereplay.domain.record import Geometry
from routereplay.rpc.client import RouteCacheClient
from routereplay.v1 import route_cache_pb2

# Small but shaped like the real thing: a dense layer 0, MoE layers 1-5, top-4 of 16.
SMALL = Geometry((1, 2, 3, 4, 5), topk=4, num_experts=16, model_id="test-moe")
# Over 256 experts: routes are uint16.
WIDE = Geometry((0, 1, 2), topk=6, num_experts=300, model_id="test-wide")


@pytest.fixture(params=["single", "cluster"])
def redis_client(request, redis_node):
    if request.param == "single":
        client = connect(redis_node.url, cluster=False)
    else:
        nodes = request.getfixturevalue("redis_cluster_nodes")
        client = connect(nodes[0].url.rsplit("/", 1)[0], cluster=True)
    yield client
    client.close()


@pytest.fixture
def store(redis_client):
    return RouteStore(redis_client, ttl_ms=600_000, batch_window=3)


@pytest.fixture
def cache(store):
    """A route cache server on a free port over ``store``, and a client for it."""
    server = RouteCacheServer(
        Config(host="127.0.0.1", port=0, grace_s=1, health_interval_s=0.1), store
    ).start()
    client = RouteCacheClient(f"127.0.0.1:{server.port}", timeout_s=30)
    yield client, server
    client.close()
    server.stop(0)


@pytest.fixture
def rng(request):
    return np.random.default_rng(abs(hash(request.node.name)) % 2**32)


@pytest.fixture
def sid():
    """A fresh sample id per call."""
    return lambda prefix="s": f"{prefix}-{uuid.uuid4().hex[:12]}"


def raw_keys(client, pattern: str) -> list[bytes]:
    """Every key matching ``pattern`` on every node (a cluster's SCAN is per node)."""
    if isinstance(client, redis.cluster.RedisCluster):
        return list(client.scan_iter(match=pattern, target_nodes=client.ALL_NODES))
    return list(client.scan_iter(match=pattern))


def as_messages(requests, kind=route_cache_pb2.WriteRecordRequest, split_first=False) -> list:
    """A ``write_requests`` or ``append_requests`` stream (serialized) as ``kind`` messages,
    for the generated stubs; ``split_first``: the header's first chunk moved to a message of
    its own, as clients before ``first_chunk`` sent it."""
    messages = [kind.FromString(r) for r in requests]
    if split_first and messages and messages[0].HasField("first_chunk"):
        messages.insert(1, kind(chunk=messages[0].first_chunk))
        messages[0].ClearField("first_chunk")
    return messages
