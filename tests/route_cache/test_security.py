"""The route cache's security and abuse limits over real gRPC sockets and real redis-server
processes: TLS, mutual TLS, the bearer token, undecodable requests, the stream and size
limits, and Redis with a password, an ACL user and TLS."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import uuid

import grpc
import numpy as np
import pytest
import redis
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from route_cache.config import Config, RedisSecurity
from route_cache.connection import connect
from route_cache.record_format import record_key
from route_cache.server import RouteCacheServer
from route_cache.store import RouteStore
from routereplay.dev.devcerts import generate
from routereplay.dev.launch import free_port, start_service, stop_process
from routereplay.dev.redis_nodes import RedisProcess, start_cluster
from routereplay.dev.synthetic import synthetic_record
from routereplay.domain.codec import Encoding
from routereplay.errors import InvalidArgument, NotFound, ResourceExhausted, RouteReplayError
from routereplay.rpc.client import AsyncRouteCacheClient, RetryPolicy, RouteCacheClient
from routereplay.rpc.grpc_server import MIB, ServerLimits
from routereplay.rpc.security import (
    MISSING_TOKEN,
    PLAINTEXT,
    WRONG_TOKEN,
    ClientSecurity,
    ServerSecurity,
    secure_channel,
)
from routereplay.v1 import route_cache_pb2, route_cache_pb2_grpc
from tests.route_cache.conftest import SMALL, as_messages
from tests.support.records import encode_routes, write_requests

TOKEN = "s3cret-token-value"
NO_RETRY = RetryPolicy(attempts=1)


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return generate(tmp_path_factory.mktemp("certs"))


@pytest.fixture(scope="module")
def other_certs(tmp_path_factory):
    """A second, unrelated CA and its certificates."""
    return generate(tmp_path_factory.mktemp("other-certs"))


@pytest.fixture(scope="module")
def token_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("token") / "token"
    path.write_text(TOKEN + "\n")  # the trailing newline an editor adds is dropped
    return str(path)


@pytest.fixture
def serve(redis_node):
    """Starts route cache servers over the shared test Redis; stops them at the end."""
    servers = []
    redis_client = connect(redis_node.url, cluster=False)

    def start(**overrides) -> str:
        config = Config(host="127.0.0.1", port=0, grace_s=1, health_interval_s=0.1, **overrides)
        servers.append(RouteCacheServer(config, RouteStore(redis_client, ttl_ms=600_000)).start())
        return f"127.0.0.1:{servers[-1].port}"

    yield start
    for server in servers:
        server.stop(0)
    redis_client.close()


def round_trip(target: str, security: ClientSecurity, seed: int = 0) -> None:
    record = synthetic_record(
        f"sec-{seed}-{np.random.randint(1 << 30)}", SMALL, 300, np.random.default_rng(seed)
    )
    with RouteCacheClient(target, timeout_s=10, retry=NO_RETRY, security=security) as client:
        client.write(record)
        np.testing.assert_array_equal(client.read(record.sample_id).routes, record.routes)


def health(target: str, security: ClientSecurity = PLAINTEXT) -> int:
    with secure_channel(target, security) as channel:
        request = health_pb2.HealthCheckRequest(service="routereplay.v1.RouteCache")
        return health_pb2_grpc.HealthStub(channel).Check(request, timeout=5).status


# --- TLS ----------------------------------------------------------------------------------


def test_tls(serve, certs, other_certs):
    target = serve(
        security=ServerSecurity(str(certs / "server.pem"), str(certs / "server-key.pem"))
    )
    round_trip(target, ClientSecurity(ca_file=str(certs / "ca.pem")))
    assert health(target, ClientSecurity(ca_file=str(certs / "ca.pem"))) == 1  # SERVING
    for wrong in (ClientSecurity(), ClientSecurity(ca_file=str(other_certs / "ca.pem"))):
        with pytest.raises(RouteReplayError):  # plaintext, or a CA that did not sign it
            round_trip(target, wrong)


def test_mutual_tls(serve, certs, other_certs):
    security = ServerSecurity(
        str(certs / "server.pem"),
        str(certs / "server-key.pem"),
        tls_client_ca_file=str(certs / "ca.pem"),
    )
    target = serve(security=security)
    ca = str(certs / "ca.pem")
    round_trip(
        target,
        ClientSecurity(
            ca_file=ca, cert_file=str(certs / "client.pem"), key_file=str(certs / "client-key.pem")
        ),
    )
    no_cert = ClientSecurity(ca_file=ca)
    foreign = ClientSecurity(
        ca_file=ca,
        cert_file=str(other_certs / "client.pem"),
        key_file=str(other_certs / "client-key.pem"),
    )
    for wrong in (no_cert, foreign):
        with pytest.raises(RouteReplayError):
            round_trip(target, wrong)


# --- the bearer token ---------------------------------------------------------------------


def test_token(serve, token_file):
    target = serve(security=ServerSecurity(auth_token_file=token_file))
    round_trip(target, ClientSecurity(token=TOKEN))
    round_trip(target, ClientSecurity(token_file=token_file))
    for security, message in [
        (ClientSecurity(), MISSING_TOKEN),
        (ClientSecurity(token="s3cret-token-valuX"), WRONG_TOKEN),
        (ClientSecurity(token=TOKEN[:-1]), WRONG_TOKEN),
    ]:
        with RouteCacheClient(target, timeout_s=10, retry=NO_RETRY, security=security) as client:
            with pytest.raises(RouteReplayError) as info:  # a unary call
                client.stat("any")
            assert str(info.value) == message  # names the problem, echoes no token
            with pytest.raises(RouteReplayError, match="bearer token"):  # server streaming
                list(client.read_batch(["any"]))
            with pytest.raises(RouteReplayError, match="bearer token"):  # client streaming
                client.write(synthetic_record("t", SMALL, 20, np.random.default_rng(0)))
    # Probes need no token; reflection does.
    assert health(target) == health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(target) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        with pytest.raises(grpc.RpcError) as info:
            next(stub.ServerReflectionInfo(iter([request]), timeout=5))
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_token_async_client_over_tls(serve, certs, token_file):
    import asyncio

    security = ServerSecurity(
        str(certs / "server.pem"), str(certs / "server-key.pem"), auth_token_file=token_file
    )
    target = serve(security=security)
    record = synthetic_record("sec-async", SMALL, 100, np.random.default_rng(1))

    async def main(client_security):
        async with AsyncRouteCacheClient(
            target, timeout_s=10, retry=NO_RETRY, security=client_security
        ) as client:
            await client.write(record)
            got = [r async for r in client.read_batch([record.sample_id])]
            np.testing.assert_array_equal(got[0].routes, record.routes)

    asyncio.run(main(ClientSecurity(ca_file=str(certs / "ca.pem"), token=TOKEN)))
    with pytest.raises(RouteReplayError, match="missing bearer token"):
        asyncio.run(main(ClientSecurity(ca_file=str(certs / "ca.pem"))))


# --- undecodable requests -----------------------------------------------------------------

GARBAGE = b"\x0a\xff\x01garbage"  # field 1 claims 255 bytes; 8 follow


def test_garbage_requests_are_invalid_and_do_not_stall_the_connection(serve):
    """100 undecodable requests on ONE channel, then a valid call on the same channel: each
    gets INVALID_ARGUMENT, and the connection still serves (grpcio's own deserializer left a
    stream open per call and refused everything after 32)."""
    target = serve()
    with grpc.insecure_channel(target) as channel:
        stat = channel.unary_unary("/routereplay.v1.RouteCache/StatRecord")
        for _ in range(100):
            with pytest.raises(grpc.RpcError) as info:
                stat(GARBAGE, timeout=5)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert info.value.details().startswith(
                "request is not a valid routereplay.v1.StatRecordRequest: "
            )
        # Streaming requests: a good header, then garbage.
        write = channel.stream_unary("/routereplay.v1.RouteCache/WriteRecord")
        record = synthetic_record("sec-garbage", SMALL, 50, np.random.default_rng(2))
        encoded = encode_routes(record.routes, Encoding.RAW)
        header = as_messages(write_requests(record, encoded), split_first=True)[0]
        with pytest.raises(grpc.RpcError) as info:
            write(iter([header.SerializeToString(), GARBAGE]), timeout=5)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid routereplay.v1.WriteRecordRequest" in info.value.details()
        stub = route_cache_pb2_grpc.RouteCacheStub(channel)
        request = route_cache_pb2.StatRecordRequest(sample_id="no-such-sample")
        with pytest.raises(grpc.RpcError) as info:
            stub.StatRecord(request, timeout=5)
        assert info.value.code() == grpc.StatusCode.NOT_FOUND  # parsed and answered
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert check.status == health_pb2.HealthCheckResponse.SERVING


UNARY_METHODS = ["StatRecord", "DeleteRecord", "ReadReady", "AckReady"]
STREAM_METHODS = ["ReadRecord", "ReadBatch"]  # one request, a stream of replies
CLIENT_STREAM_METHODS = ["WriteRecord", "AppendTurn"]
# What random bytes may get: a refusal when they parse, INVALID_ARGUMENT when they do not.
# INTERNAL, UNKNOWN or UNAVAILABLE would be bugs.
ANSWERS = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.FAILED_PRECONDITION,
}


def test_random_bytes_to_every_method_on_one_channel(serve):
    """Byte-level fuzzing: random request bytes to every RouteCache method, all on ONE
    channel, never get a bug status, and the channel still serves after them."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    target = serve(ready_max_block_ms=0)  # a parsed ReadReady may not wait
    with grpc.insecure_channel(target) as channel:

        def code_of(call, *args) -> grpc.StatusCode:
            try:
                reply = call(*args, timeout=10)
                if hasattr(reply, "__next__"):
                    list(reply)
                return grpc.StatusCode.OK
            except grpc.RpcError as exc:
                assert exc.code() in ANSWERS, (exc.code(), exc.details())
                return exc.code()

        @settings(
            max_examples=300,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture],
        )
        @given(
            st.sampled_from(UNARY_METHODS + STREAM_METHODS + CLIENT_STREAM_METHODS),
            st.lists(st.binary(max_size=120), min_size=1, max_size=4),
        )
        def check(method, messages):
            path = f"/routereplay.v1.RouteCache/{method}"
            if method in UNARY_METHODS:
                code_of(channel.unary_unary(path), messages[0])
            elif method in STREAM_METHODS:
                code_of(channel.unary_stream(path), messages[0])
            else:
                code_of(channel.stream_unary(path), iter(messages))

        check()
        assert (
            code_of(channel.unary_unary("/routereplay.v1.RouteCache/StatRecord"), GARBAGE)
            == grpc.StatusCode.INVALID_ARGUMENT
        )
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert reply.status == health_pb2.HealthCheckResponse.SERVING


# --- limits -------------------------------------------------------------------------------


def test_chunks_per_write_limit(serve, redis_node):
    target = serve(max_write_chunks=4)
    record = synthetic_record("sec-chunks", SMALL, 300, np.random.default_rng(3))  # 5,980 B
    with RouteCacheClient(target, timeout_s=10, retry=NO_RETRY, chunk_bytes=1024) as client:
        with pytest.raises(ResourceExhausted, match=r"more than 4 chunks.*max_write_chunks"):
            client.write(record)  # 6 chunks
        client.chunk_bytes = 2048  # 3 chunks
        client.write(record)
    # An endless stream of empty chunks that never ends its block is cut off too.
    encoded = encode_routes(record.routes, Encoding.RAW)
    header = as_messages(write_requests(record, encoded), split_first=True)[0]
    header.header.sample_id = "sec-endless"

    def endless():
        yield header
        while True:
            yield route_cache_pb2.WriteRecordRequest(chunk={"block": 0, "offset": 0})

    with grpc.insecure_channel(target) as channel:
        with pytest.raises(grpc.RpcError) as info:
            route_cache_pb2_grpc.RouteCacheStub(channel).WriteRecord(endless(), timeout=10)
    assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert not redis.Redis.from_url(redis_node.url).exists(record_key("sec-endless"))


def test_block_size_limit(serve):
    target = serve(max_record_mib=1)
    record = synthetic_record("sec-big", SMALL, 60000, np.random.default_rng(5))  # 1.2 MB
    with RouteCacheClient(target, timeout_s=10, retry=NO_RETRY) as client:
        with pytest.raises(InvalidArgument, match="exceeds the server's limit of 1048576 bytes"):
            client.write(record)
        with pytest.raises(NotFound):
            client.stat(record.sample_id)


def test_message_size_limit(serve):
    target = serve(limits=ServerLimits(max_message_bytes=MIB // 4))
    record = synthetic_record("sec-size", SMALL, 20000, np.random.default_rng(4))  # 400 KB
    with RouteCacheClient(target, timeout_s=10, retry=NO_RETRY) as client:  # 1 MiB chunks
        with pytest.raises(ResourceExhausted, match="larger than max"):
            client.write(record)
        client.chunk_bytes = MIB // 8
        client.write(record)


def test_concurrent_rpc_limit(serve):
    """One ReadReady call waits for new entries and holds the only slot; other calls are refused
    until it ends."""
    target = serve(limits=ServerLimits(max_concurrent_rpcs=1))
    client = RouteCacheClient(target, timeout_s=30, retry=NO_RETRY)
    holding = threading.Event()

    def hold():
        while not holding.is_set():  # the other calls below may take the slot first
            try:
                client.read_ready(
                    f"sec-{uuid.uuid4().hex}", "c0", block_ms=3000, start_from_latest=True
                )
                return
            except ResourceExhausted:
                pass

    thread = threading.Thread(target=hold)
    thread.start()
    try:
        with RouteCacheClient(target, timeout_s=5, retry=NO_RETRY) as other:
            for _ in range(500):
                try:
                    other.stat("sec-none")
                except ResourceExhausted as exc:
                    assert str(exc) == "Concurrent RPC limit exceeded!"
                    break
                except NotFound:  # the slot was free: answered
                    threading.Event().wait(0.01)
            else:
                pytest.fail("no call was ever refused")
            thread.join()
            with pytest.raises(NotFound):  # the slot is free again
                other.stat("sec-none")
    finally:
        holding.set()
        thread.join()
        client.close()


def test_concurrent_streams_per_connection_limit(serve):
    """With one HTTP/2 stream per connection, a waiting ReadReady leaves its connection no
    stream: a call on that channel waits past its deadline while another channel is served."""
    target = serve(limits=ServerLimits(max_concurrent_streams=1))
    with RouteCacheClient(target, timeout_s=2, retry=NO_RETRY) as shared:
        holder = threading.Thread(
            target=shared.read_ready,
            args=(f"sec-{uuid.uuid4().hex}", "c0"),
            kwargs={"block_ms": 3000, "start_from_latest": True},
        )
        holder.start()
        try:
            for _ in range(100):
                try:
                    shared.stat("sec-none")  # answered: the holder had not started yet
                except NotFound:
                    continue
                except RouteReplayError as exc:
                    assert "Deadline Exceeded" in str(exc)
                    break
            else:
                pytest.fail("the shared connection never ran out of streams")
            with RouteCacheClient(target, timeout_s=5, retry=NO_RETRY) as other:
                with pytest.raises(NotFound):  # another connection has its own streams
                    other.stat("sec-none")
        finally:
            holder.join()


# --- Redis: password, ACL user, TLS -------------------------------------------------------


@pytest.fixture(scope="module")
def secured_redis(certs):
    """A redis-server started with an ACL user and a TLS port beside the plain one; the
    default user's password (``requirepass``) is set once it runs, because the start-up check
    pings as the default user without one."""
    tls_port = free_port()
    node = RedisProcess(
        "--user",
        "rr",
        "on",
        ">rr-pass",
        "~rr:*",
        "+@all",
        "--tls-port",
        str(tls_port),
        "--tls-cert-file",
        str(certs / "server.pem"),
        "--tls-key-file",
        str(certs / "server-key.pem"),
        "--tls-ca-cert-file",
        str(certs / "ca.pem"),
        "--tls-auth-clients",
        "optional",
    ).start()
    redis.Redis(port=node.port).config_set("requirepass", "default-pass")
    yield node, tls_port
    node.stop()


def ping(url: str, **security) -> bool:
    client = connect(url, False, socket_timeout=5, **RedisSecurity(**security).connect_kwargs())
    try:
        return RouteStore(client).ping()
    finally:
        client.close()


def test_redis_password_and_acl_user(secured_redis, tmp_path):
    node, _ = secured_redis
    url = f"redis://127.0.0.1:{node.port}/0"
    password_file = tmp_path / "pw"
    password_file.write_text("default-pass\n")
    assert ping(url, password_file=str(password_file))
    assert ping(url, password="default-pass")
    assert ping(url, username="rr", password="rr-pass")
    assert ping(f"redis://rr:rr-pass@127.0.0.1:{node.port}/0")
    assert not ping(url)
    assert not ping(url, password="wrong")
    assert not ping(url, username="rr", password="default-pass")


def test_redis_cluster_with_a_password():
    nodes = start_cluster(3)
    try:
        for node in nodes:
            redis.Redis(port=node.port).config_set("requirepass", "cluster-pass")
        url = nodes[0].url.rsplit("/", 1)[0]
        client = connect(url, True, **RedisSecurity(password="cluster-pass").connect_kwargs())
        store = RouteStore(client)
        assert store.ping()
        keys = [f"rr:{{k{i}}}" for i in range(30)]  # spread over the three masters
        for key in keys:
            client.set(key, key)
        assert [client.get(k).decode() for k in keys] == keys
        client.close()
        with pytest.raises(redis.exceptions.RedisClusterException, match="authenticated"):
            connect(url, True)
    finally:
        for node in nodes:
            node.kill()


def test_redis_tls(secured_redis, certs, other_certs):
    node, tls_port = secured_redis
    url = f"rediss://127.0.0.1:{tls_port}/0"
    ca = str(certs / "ca.pem")
    assert ping(url, password="default-pass", tls_ca_file=ca)
    assert ping(
        url,
        password="default-pass",
        tls_ca_file=ca,
        tls_cert_file=str(certs / "client.pem"),
        tls_key_file=str(certs / "client-key.pem"),
    )
    assert not ping(url, password="default-pass", tls_ca_file=str(other_certs / "ca.pem"))
    assert not ping(f"redis://127.0.0.1:{tls_port}/0", password="default-pass")
    with pytest.raises(ValueError, match="rediss://"):
        Config(redis_url=f"redis://127.0.0.1:{tls_port}/0", redis=RedisSecurity(tls_ca_file=ca))


def test_route_cache_process_with_every_secret_from_files(
    secured_redis, certs, token_file, tmp_path
):
    """``python -m route_cache`` configured only through its environment, the way the deploy
    files do it: Redis over TLS with an ACL user's password file, gRPC over TLS with a token."""
    import os

    node, tls_port = secured_redis
    password_file = tmp_path / "redis-pw"
    password_file.write_text("rr-pass")
    env = {
        **os.environ,
        "ROUTE_CACHE_REDIS_URL": f"rediss://127.0.0.1:{tls_port}/0",
        "ROUTE_CACHE_REDIS_USERNAME": "rr",
        "ROUTE_CACHE_REDIS_PASSWORD_FILE": str(password_file),
        "ROUTE_CACHE_REDIS_TLS_CA_FILE": str(certs / "ca.pem"),
        "ROUTE_CACHE_TLS_CERT_FILE": str(certs / "server.pem"),
        "ROUTE_CACHE_TLS_KEY_FILE": str(certs / "server-key.pem"),
        "ROUTE_CACHE_AUTH_TOKEN_FILE": token_file,
    }
    tls = ClientSecurity(ca_file=str(certs / "ca.pem"))
    proc, target = start_service("route_cache", env=env, quiet=True, timeout_s=30, security=tls)
    try:
        round_trip(target, ClientSecurity(ca_file=str(certs / "ca.pem"), token=TOKEN), seed=7)
        with pytest.raises(RouteReplayError, match="missing bearer token"):
            round_trip(target, tls)
    finally:
        assert stop_process(proc, 10) == 0


def test_container_healthcheck_over_mutual_tls(serve, certs, token_file):
    """The health command the compose file and images run reaches a mutual-TLS server with
    the CA and client certificate from its environment, and no token."""
    security = ServerSecurity(
        str(certs / "server.pem"),
        str(certs / "server-key.pem"),
        tls_client_ca_file=str(certs / "ca.pem"),
        auth_token_file=token_file,
    )
    target = serve(security=security)

    def check(**env) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "routereplay.rpc.healthcheck", target],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=60,
        )

    assert check().returncode == 1  # plaintext against TLS
    assert check(HEALTHCHECK_CA_FILE=str(certs / "ca.pem")).returncode == 1  # no client cert
    ok = check(
        HEALTHCHECK_CA_FILE=str(certs / "ca.pem"),
        HEALTHCHECK_CERT_FILE=str(certs / "client.pem"),
        HEALTHCHECK_KEY_FILE=str(certs / "client-key.pem"),
    )
    assert (ok.returncode, ok.stdout.strip()) == (0, "SERVING")
