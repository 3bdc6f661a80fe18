"""Redis failing in ways that health must see: a Redis Cluster with every node down for good,
and a Redis that accepts connections but never answers (a real redis-server under SIGSTOP)."""

from __future__ import annotations

import os
import signal
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from route_cache.config import Config
from route_cache.connection import connect
from route_cache.server import SERVICE_NAME, RouteCacheServer
from route_cache.store import RouteStore
from routereplay.dev.launch import start_service, stop_process
from routereplay.dev.redis_nodes import RedisProcess, start_cluster
from routereplay.dev.synthetic import synthetic_record
from routereplay.errors import Unavailable
from routereplay.rpc.client import RetryPolicy, RouteCacheClient
from routereplay.rpc.grpc_server import LIVENESS
from routereplay.v1 import route_cache_pb2, route_cache_pb2_grpc
from tests.route_cache.conftest import SMALL
from tests.route_cache.test_process import health_until

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
NO_RETRY = RetryPolicy(attempts=1)


def status(stub, service: str, timeout_s: float = 5) -> int:
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout_s).status


@pytest.mark.slow
def test_cluster_down_for_good_turns_readiness_off_and_calls_unavailable(rng):
    """Every node of a Redis Cluster SIGKILLed: readiness turns NOT_SERVING (the thread that
    tracks Redis used to die on redis-py's RedisClusterException and leave it SERVING for good),
    each kind of call fails with UNAVAILABLE (retried by clients) rather than INTERNAL, and once
    the nodes are back readiness turns SERVING again and writes land."""
    nodes = start_cluster(3)
    client = connect(nodes[0].url, cluster=True, socket_timeout=2, socket_connect_timeout=1)
    config = Config(
        host="127.0.0.1",
        port=0,
        redis_cluster=True,
        grace_s=1,
        health_interval_s=0.1,
        health_timeout_s=1,
    )
    server = RouteCacheServer(config, RouteStore(client)).start()
    target = f"127.0.0.1:{server.port}"
    try:
        with (
            grpc.insecure_channel(target) as channel,
            RouteCacheClient(target, timeout_s=10, retry=NO_RETRY) as cache,
        ):
            health = health_pb2_grpc.HealthStub(channel)
            assert health_until(health, SERVICE_NAME, SERVING) == SERVING
            for node in nodes:
                node.kill()
            assert health_until(health, SERVICE_NAME, NOT_SERVING, 10) == NOT_SERVING
            assert status(health, LIVENESS) == SERVING  # an outage restarts nothing
            record = synthetic_record("down-for-good", SMALL, 40, rng)
            calls = {
                "write": lambda: cache.write(record),
                "read": lambda: cache.read("down-for-good"),
                "stat": lambda: cache.stat("down-for-good"),
                "read_ready": lambda: cache.read_ready("g", "c"),
                "ack_ready": lambda: cache.ack_ready("g", ["1-0"]),
            }
            for name, call in calls.items():
                with pytest.raises(Unavailable, match="unreachable"):
                    call()
                assert name  # named in the traceback when a call is not refused so
            time.sleep(0.5)  # the tracker has probed the dead cluster a few more times
            assert status(health, SERVICE_NAME) == NOT_SERVING
            for node in nodes:  # same ports and cluster configuration files
                node.start()
            assert health_until(health, SERVICE_NAME, SERVING, 30) == SERVING
            deadline = time.monotonic() + 30
            while True:  # the cluster may take a moment to agree its slots are covered
                try:
                    assert cache.write(record).num_rows == 39
                    break
                except Unavailable:
                    assert time.monotonic() < deadline
                    time.sleep(0.2)
    finally:
        server.stop(0)
        for node in nodes:
            node.kill()


@pytest.mark.slow
def test_a_hung_redis_leaves_health_answering_and_readiness_off():
    """Redis SIGSTOPped (connections are accepted, nothing is answered) under a route cache
    process whose 16 handler threads are all held by calls waiting on it: health checks with the
    kubelet's 1 s time-out all answer (liveness SERVING, so the busy replica is not restarted),
    and readiness turns NOT_SERVING within the probe's time-out plus an interval. After SIGCONT
    readiness serves again and the held calls finish."""
    redis_node = RedisProcess().start()
    env = {
        **os.environ,
        "ROUTE_CACHE_REDIS_URL": redis_node.url,
        "ROUTE_CACHE_HEALTH_INTERVAL_S": "0.2",
        "ROUTE_CACHE_HEALTH_TIMEOUT_S": "0.5",
        "ROUTE_CACHE_WORKERS": "16",
    }
    cache, target = start_service("route_cache", env=env, timeout_s=30)
    held = []
    try:
        with grpc.insecure_channel(target) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            assert health_until(health, SERVICE_NAME, SERVING) == SERVING
            stub = route_cache_pb2_grpc.RouteCacheStub(channel)
            redis_node.proc.send_signal(signal.SIGSTOP)
            stopped_at = time.monotonic()
            # More calls than handler threads: each waits on Redis (30 s socket time-out).
            held = [
                stub.StatRecord.future(
                    route_cache_pb2.StatRecordRequest(sample_id=f"h{i}"), timeout=60
                )
                for i in range(24)
            ]
            time.sleep(0.5)
            assert not any(call.done() for call in held)
            answers, not_serving_after = [], None
            while time.monotonic() - stopped_at < 6:
                for service in (LIVENESS, SERVICE_NAME):
                    try:
                        answers.append((service, status(health, service, timeout_s=1)))
                    except grpc.RpcError as exc:  # what the kubelet counts as a failed probe
                        answers.append((service, exc.code().name))
                if not_serving_after is None and answers[-1] == (SERVICE_NAME, NOT_SERVING):
                    not_serving_after = time.monotonic() - stopped_at
                time.sleep(0.2)
            print(
                f"readiness NOT_SERVING {not_serving_after} s after SIGSTOP; "
                f"{len(answers)} probes answered"
            )
            assert {a for s, a in answers if s == LIVENESS} == {SERVING}, answers
            assert {a for s, a in answers if s == SERVICE_NAME} <= {SERVING, NOT_SERVING}, answers
            assert not_serving_after is not None and not_serving_after < 3, answers
            assert answers[-1] == (SERVICE_NAME, NOT_SERVING)
            redis_node.proc.send_signal(signal.SIGCONT)
            assert health_until(health, SERVICE_NAME, SERVING, 10) == SERVING
            for call in held:  # answered by Redis once it runs again: no such record
                assert call.exception(30).code() == grpc.StatusCode.NOT_FOUND
    finally:
        redis_node.proc.send_signal(signal.SIGCONT)
        for call in held:
            call.cancel()
        stop_process(cache, 5)
        redis_node.kill()
