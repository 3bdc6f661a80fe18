"""The rollout server secured end to end: mutual TLS and a token on its own port, TLS and a
token to a secured route cache, undecodable requests; real vLLM, real route cache, real Redis."""

from __future__ import annotations

import grpc
import pytest

from rollout_server.server import RolloutServer
from route_cache.config import Config as CacheConfig
from route_cache.connection import connect
from route_cache.server import RouteCacheServer
from route_cache.store import RouteStore
from routereplay.dev.devcerts import generate
from routereplay.domain.rollout import SampleDone, SamplingOptions
from routereplay.errors import InvalidArgument, ResourceExhausted, RouteReplayError
from routereplay.rpc.client import RouteCacheClient
from routereplay.rpc.grpc_server import MIB, ServerLimits
from routereplay.rpc.rollout_client import AsyncRolloutClient
from routereplay.rpc.security import ClientSecurity, ServerSecurity, secure_aio_channel
from routereplay.v1 import rollout_pb2, rollout_pb2_grpc
from tests.rollout_server.conftest import rollout_config

GARBAGE = b"\x0a\xff\x01garbage"


def test_secured_rollout_server_writes_to_a_secured_route_cache(
    vllm_engine, loop, redis_node, tmp_path
):
    certs = generate(tmp_path / "certs")
    ca, token = str(certs / "ca.pem"), tmp_path / "token"
    token.write_text("rollout-token")
    tls = dict(tls_cert_file=str(certs / "server.pem"), tls_key_file=str(certs / "server-key.pem"))
    cache_security = ServerSecurity(**tls, auth_token_file=str(token))
    cache_config = CacheConfig(host="127.0.0.1", port=0, grace_s=1, security=cache_security)
    cache = RouteCacheServer(cache_config, RouteStore(connect(redis_node.url, False))).start()
    cache_target = f"127.0.0.1:{cache.port}"
    to_cache = ClientSecurity(ca_file=ca, token_file=str(token))
    config = rollout_config(
        cache_target,
        security=ServerSecurity(**tls, tls_client_ca_file=ca, auth_token_file=str(token)),
        route_cache_security=to_cache,
        max_prompts=2,
        limits=ServerLimits(max_message_bytes=MIB),
    )
    client_cert = dict(cert_file=str(certs / "client.pem"), key_file=str(certs / "client-key.pem"))
    allowed = ClientSecurity(ca_file=ca, token_file=str(token), **client_cert)

    async def main():
        server = await RolloutServer(config, vllm_engine).start()
        target = f"127.0.0.1:{server.port}"
        try:
            async with AsyncRolloutClient(target, timeout_s=120, security=allowed) as client:
                options = SamplingOptions(temperature=0.0, max_tokens=6)
                events = [e async for e in client.generate("Secure hello", options, "sec-r1")]
                done = events[-1]
                assert isinstance(done, SampleDone) and done.stored, done
                with pytest.raises(InvalidArgument, match=r"prompts \(count\) is 3; .* \[1, 2\]"):
                    [e async for e in client.generate_batch(["a", "b", "c"], 1, options)]
                with pytest.raises(ResourceExhausted, match="larger than max"):
                    [e async for e in client.generate("x" * (2 * MIB), options)]
            for refused, match in [
                (ClientSecurity(ca_file=ca, **client_cert), "missing bearer token"),
                (ClientSecurity(ca_file=ca, token_file=str(token)), None),  # no client cert
            ]:
                async with AsyncRolloutClient(target, timeout_s=30, security=refused) as client:
                    with pytest.raises(RouteReplayError, match=match):
                        await client.status()
            async with secure_aio_channel(target, allowed) as channel:
                raw = channel.unary_unary("/routereplay.v1.Rollout/GetStatus")
                for _ in range(100):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await raw(GARBAGE, timeout=5)
                    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                    assert "not a valid routereplay.v1.GetStatusRequest" in info.value.details()
                stub = rollout_pb2_grpc.RolloutStub(channel)
                status = await stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=10)
                assert status.counters  # the same channel still serves
        finally:
            await server.stop(1)
        return done

    try:
        done = loop.run_until_complete(main())
        with RouteCacheClient(cache_target, timeout_s=10, security=to_cache) as reader:
            record = reader.read("sec-r1")  # stored through TLS with the token
        assert record.num_tokens == done.num_tokens
        assert record.routes.shape[0] == done.num_tokens - 1
    finally:
        cache.stop(0)
