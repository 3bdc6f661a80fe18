"""One client target naming two route cache replicas (what a headless Service's DNS name gives):
calls spread over both, skip one that is down, and reach it again once it is back.

Found by the fault run: with gRPC's default policy (pick_first) every call went to the first
replica for as long as it answered, and a client that failed over stayed on the other.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from route_cache.config import Config
from route_cache.connection import connect
from route_cache.server import RouteCacheServer
from route_cache.store import RouteStore
from routereplay.dev.synthetic import synthetic_record
from routereplay.rpc.client import RetryPolicy, RouteCacheClient
from tests.route_cache.conftest import SMALL


def start_replica(url: str, port: int = 0) -> RouteCacheServer:
    config = Config(host="127.0.0.1", port=port, grace_s=0, health_interval_s=0.1)
    return RouteCacheServer(config, RouteStore(connect(url, cluster=False))).start()


def committed(server: RouteCacheServer) -> int:
    """Writes this replica committed (its own counter: the server side is the oracle)."""
    (family,) = server.cache.metrics.committed.collect()
    return int(sum(s.value for s in family.samples if s.name.endswith("_total")))


def test_calls_spread_fail_over_and_come_back(redis_node, sid):
    rng = np.random.default_rng(0)
    replicas = [start_replica(redis_node.url) for _ in range(2)]
    ports = [r.port for r in replicas]
    target = "ipv4:" + ",".join(f"127.0.0.1:{p}" for p in ports)
    retry = RetryPolicy(attempts=10, initial_backoff_s=0.05, max_backoff_s=0.2)
    try:
        with RouteCacheClient(target, timeout_s=5, retry=retry) as client:

            def write(count: int) -> None:
                for _ in range(count):
                    client.write(synthetic_record(sid(), SMALL, 16, rng))

            write(20)
            spread = [committed(r) for r in replicas]
            assert sum(spread) == 20 and min(spread) >= 5, spread  # not all on the first

            replicas[0].stop(0)  # down: every write must land on the other
            before = committed(replicas[1])
            write(10)
            assert committed(replicas[1]) - before == 10

            replicas[0] = start_replica(redis_node.url, ports[0])  # back on its address
            deadline = time.monotonic() + 5
            while committed(replicas[0]) == 0:  # the client does not stay on the survivor
                assert time.monotonic() < deadline, "the restarted replica got no call in 5 s"
                write(1)
                time.sleep(0.05)
    finally:
        for replica in replicas:
            replica.stop(0)


def test_a_call_that_outlives_its_time_out_raises_deadline_exceeded(redis_node):
    """A route cache behind a proxy that black-holes the open connection: the client's
    time-out ends the call with DEADLINE_EXCEEDED, not INTERNAL (the fault run logged its
    writers' time-outs in the black holes as INTERNAL, a server fault they were not)."""
    from routereplay.dev.fault_proxy import FaultProxy
    from routereplay.errors import DeadlineExceeded, NotFound

    store = RouteStore(connect(redis_node.url, cluster=False))
    server = RouteCacheServer(Config(host="127.0.0.1", port=0, grace_s=1), store).start()
    proxy = FaultProxy(server.port).start()
    try:
        target = f"127.0.0.1:{proxy.port}"
        with RouteCacheClient(target, timeout_s=0.5, retry=RetryPolicy(attempts=1)) as client:
            with pytest.raises(NotFound):  # the connection is up
                client.stat("absent")
            proxy.blackhole(2.0)
            try:
                client.stat("absent")
            except DeadlineExceeded as exc:
                assert exc.status == "DEADLINE_EXCEEDED"
            else:
                raise AssertionError("a call into a black hole returned")
    finally:
        proxy.close()
        server.stop(0)
