"""The route cache as a real process: killed mid-stream, and stopped gracefully."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import grpc
import numpy as np
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from route_cache.server import SERVICE_NAME
from route_cache.store import STAGING_TTL_MS
from routereplay.dev.launch import free_port, start_service, stop_process
from routereplay.dev.redis_nodes import RedisProcess
from routereplay.dev.synthetic import synthetic_record
from routereplay.errors import Unavailable
from routereplay.rpc.client import RetryPolicy, RouteCacheClient
from routereplay.rpc.grpc_server import LIVENESS
from routereplay.v1 import route_cache_pb2_grpc
from tests.route_cache.conftest import SMALL, as_messages, raw_keys
from tests.support.records import encode_routes, write_requests

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class CacheProcess:
    def __init__(self, redis_url: str, port: int | None = None):
        self.port = port or free_port()
        self.redis_url = redis_url
        self.proc = None

    def start(self) -> CacheProcess:
        env = {**os.environ, "ROUTE_CACHE_REDIS_URL": self.redis_url, "ROUTE_CACHE_GRACE_S": "10"}
        self.proc, _ = start_service("route_cache", port=self.port, env=env, timeout_s=30)
        return self

    def signal(self, sig) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def slow(requests, after: int, reached: threading.Event, pause_s: float):
    """Yield ``requests``, pausing ``pause_s`` before each one after the first ``after``."""
    for i, request in enumerate(requests):
        if i == after:
            reached.set()
        if i >= after:
            time.sleep(pause_s)
        yield request


def test_killed_mid_stream_leaves_nothing_and_a_retry_stores_it_whole(redis_node, sid):
    rng = np.random.default_rng(7)
    record = synthetic_record(sid(), SMALL, 4000, rng)
    requests = as_messages(write_requests(record, encode_routes(record.routes), chunk_bytes=4096))
    assert len(requests) > 10
    cache = CacheProcess(redis_node.url).start()
    reached = threading.Event()
    errors = []

    def write():
        with grpc.insecure_channel(f"127.0.0.1:{cache.port}") as channel:
            stub = route_cache_pb2_grpc.RouteCacheStub(channel)
            try:
                stub.WriteRecord(slow(requests, 6, reached, 0.2), timeout=30)
            except grpc.RpcError as exc:
                errors.append(exc.code())

    writer = threading.Thread(target=write)
    writer.start()
    try:
        assert reached.wait(20)
        time.sleep(0.3)  # the server holds part of the stream now
        cache.signal(signal.SIGKILL)
        writer.join(30)
        assert errors == [grpc.StatusCode.UNAVAILABLE]
        client = redis.Redis.from_url(redis_node.url)
        # No record key; at most a staging hash, which expires on its own.
        for key in raw_keys(client, f"*{record.sample_id}*"):
            assert b":stage:" in key and 0 < client.pttl(key) <= STAGING_TTL_MS
        cache = CacheProcess(redis_node.url, cache.port).start()  # restarted on the same port
        with RouteCacheClient(f"127.0.0.1:{cache.port}") as retry:
            assert retry.write(record).duplicate is False
            got = retry.read(record.sample_id)
        np.testing.assert_array_equal(got.routes, record.routes)
        np.testing.assert_array_equal(got.token_ids, record.token_ids)
    finally:
        cache.stop()


def test_sigterm_lets_an_in_flight_stream_finish(redis_node, sid):
    rng = np.random.default_rng(8)
    record = synthetic_record(sid(), SMALL, 2000, rng)
    requests = as_messages(write_requests(record, encode_routes(record.routes), chunk_bytes=4096))
    cache = CacheProcess(redis_node.url).start()
    reached = threading.Event()
    results = []

    def write():
        with grpc.insecure_channel(f"127.0.0.1:{cache.port}") as channel:
            stub = route_cache_pb2_grpc.RouteCacheStub(channel)
            results.append(stub.WriteRecord(slow(requests, 3, reached, 0.3), timeout=30))

    writer = threading.Thread(target=write)
    writer.start()
    try:
        assert reached.wait(20)
        # The client has sent 3 chunks; give the server a moment to take up the call (a call
        # it has not yet begun to handle when it stops is cancelled, not finished). The rest
        # of the stream still takes about 2 s, well inside the 10 s grace.
        time.sleep(0.5)
        cache.signal(signal.SIGTERM)
        writer.join(30)
        assert results and results[0].num_rows == 1999
        assert cache.proc.wait(20) == 0
        with pytest.raises(grpc.RpcError):  # no longer accepting calls
            with grpc.insecure_channel(f"127.0.0.1:{cache.port}") as channel:
                health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=1
                )
        stored = redis.Redis.from_url(redis_node.url).hget(f"rr:{{{record.sample_id}}}", "rows")
        assert stored == b"1999"
    finally:
        cache.stop()


def test_the_client_retries_through_a_restart(redis_node, sid):
    """Writes and batch reads issued while the route cache is down succeed once it is back."""
    rng = np.random.default_rng(9)
    records = [synthetic_record(sid(), SMALL, 500, rng) for _ in range(3)]
    cache = CacheProcess(redis_node.url).start()
    retry = RetryPolicy(attempts=12, initial_backoff_s=0.2, max_backoff_s=1.0)
    try:
        with RouteCacheClient(f"127.0.0.1:{cache.port}", retry=retry, timeout_s=10) as client:
            client.write(records[0])
            cache.signal(signal.SIGKILL)
            cache.proc.wait()
            restarter = threading.Timer(1.0, cache.start)
            restarter.start()
            client.write(records[1])  # retried until the restarted server answers
            client.write(records[2])
            restarter.join()
            got = list(client.read_batch([r.sample_id for r in records]))
        for a, b in zip(got, records, strict=True):
            np.testing.assert_array_equal(a.routes, b.routes)
    finally:
        cache.stop()


def test_wait_replicas_reaches_the_store_of_the_process(redis_node, sid):
    """``--wait-replicas`` is honoured by ``python -m route_cache``: against a node without
    replicas a write is not acknowledged (UNAVAILABLE), while the same process without the
    setting acknowledges it."""
    record = synthetic_record(sid(), SMALL, 50, np.random.default_rng(3))
    for wait, acknowledged in (("1", False), ("0", True)):
        env = {
            **os.environ,
            "ROUTE_CACHE_REDIS_URL": redis_node.url,
            "ROUTE_CACHE_WAIT_REPLICAS": wait,
        }
        proc, target = start_service("route_cache", env=env, timeout_s=30, quiet=True)
        try:
            with RouteCacheClient(target, timeout_s=10, retry=RetryPolicy(attempts=1)) as client:
                if acknowledged:
                    assert client.write(record).num_rows == 49
                else:
                    with pytest.raises(Unavailable, match="replica"):
                        client.write(record)
        finally:
            proc.kill()
            proc.wait()


def probe_services() -> tuple[str, str]:
    """The health service names the route cache's liveness and readiness probes ask for, read
    from its Kubernetes manifest."""
    yaml = pytest.importorskip("yaml")
    manifest = Path(__file__).resolve().parents[2] / "k8s" / "base" / "route-cache.yaml"
    (deployment,) = [
        d for d in yaml.safe_load_all(manifest.read_text()) if d["kind"] == "Deployment"
    ]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container["livenessProbe"]["grpc"]["service"], container["readinessProbe"]["grpc"][
        "service"
    ]


def health_until(stub, service: str, want: int, deadline_s: float = 30) -> int:
    """Ask ``service``'s status until it is ``want`` (or the deadline passes); the last answer."""
    deadline = time.monotonic() + deadline_s
    while True:
        status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status
        if status == want or time.monotonic() > deadline:
            return status
        time.sleep(0.1)


def test_liveness_stays_serving_through_a_redis_outage():
    """Redis stopped under a running route cache process: the name its liveness probe asks for
    stays SERVING (the pod is not restarted), the readiness name and the overall status turn
    NOT_SERVING (no calls are routed to it); when Redis is back, both serve again."""
    liveness, readiness = probe_services()
    assert liveness == LIVENESS and readiness == SERVICE_NAME
    store = RedisProcess().start()
    cache = None
    try:
        env = {
            **os.environ,
            "ROUTE_CACHE_REDIS_URL": store.url,
            "ROUTE_CACHE_HEALTH_INTERVAL_S": "0.1",
        }
        cache, target = start_service("route_cache", env=env, timeout_s=30)
        with grpc.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for service in (liveness, readiness, ""):
                assert health_until(stub, service, SERVING) == SERVING, service
            store.stop()
            assert health_until(stub, readiness, NOT_SERVING) == NOT_SERVING
            assert health_until(stub, "", NOT_SERVING) == NOT_SERVING
            # Asked after the watcher has seen the outage.
            assert health_until(stub, liveness, NOT_SERVING, deadline_s=0) == SERVING
            assert cache.poll() is None
            store.start()
            for service in (readiness, "", liveness):
                assert health_until(stub, service, SERVING) == SERVING, service
    finally:
        if cache is not None:
            stop_process(cache, 5)
        store.kill()
