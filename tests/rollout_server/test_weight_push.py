"""The trainer's weight push (``trainer.policy_sync.push_weights``) against a real rollout server
(real vLLM) that wants TLS and a bearer token: the new policy version comes back, and the next
sample's record carries it; without the token the push is refused. The pushed checkpoint is the
one the engine serves already, so the session's other tests keep their weights."""

from __future__ import annotations

import asyncio

import pytest

from rollout_server.server import RolloutServer
from routereplay.dev.devcerts import generate
from routereplay.domain.rollout import SampleDone, SamplingOptions
from routereplay.errors import RouteReplayError
from routereplay.rpc.rollout_client import AsyncRolloutClient
from routereplay.rpc.security import ClientSecurity, ServerSecurity
from tests.rollout_server.conftest import rollout_config
from trainer.policy_sync import push_weights


def test_push_reaches_a_secured_rollout_server(
    vllm_engine, loop, route_cache, cache_reader, tiny_model_dir, tmp_path
):
    certs = generate(tmp_path / "certs")
    ca, token = str(certs / "ca.pem"), tmp_path / "token"
    token.write_text("push-token")
    security = ServerSecurity(
        tls_cert_file=str(certs / "server.pem"),
        tls_key_file=str(certs / "server-key.pem"),
        auth_token_file=str(token),
    )
    allowed = ClientSecurity(ca_file=ca, token_file=str(token))

    async def main():
        server = await RolloutServer(
            rollout_config(route_cache.target, security=security), vllm_engine
        ).start()
        target = f"127.0.0.1:{server.port}"
        # push_weights blocks: run it beside the event loop that serves the server.
        run = asyncio.get_running_loop().run_in_executor
        try:
            before = server.rollout.policy_version
            with pytest.raises(RouteReplayError, match="missing bearer token"):
                await run(None, push_weights, target, tiny_model_dir, ClientSecurity(ca_file=ca))
            assert server.rollout.policy_version == before
            versions = await run(None, push_weights, f" {target}, ", tiny_model_dir, allowed)
            async with AsyncRolloutClient(target, timeout_s=120, security=allowed) as client:
                options = SamplingOptions(temperature=0.0, max_tokens=4)
                events = [e async for e in client.generate("After the push", options)]
        finally:
            await server.stop(1)
        return before, versions, events[-1]

    before, versions, done = loop.run_until_complete(main())
    assert versions == [before + 1]
    assert isinstance(done, SampleDone) and done.stored, done
    record = cache_reader.read(done.sample_id)
    assert [t.policy_version for t in record.turns] == [before + 1]
