"""Clients of the Rollout service, sync and asyncio, that speak the domain types.

Events come back as ``SampleDelta`` / ``SampleDone`` / ``SampleFailed``
(``routereplay.domain.rollout``); failed calls raise the domain errors of ``routereplay.errors``.
Both clients build the same requests (``_generate``, ``_generate_batch``, ``_continue``) and
differ only in how they wait.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Sequence

import grpc

from routereplay.domain.rollout import SampleEvent, SamplingOptions, ServerStatus, WeightsUpdate
from routereplay.rpc.client import domain_error
from routereplay.rpc.grpc_server import MIB, channel_options
from routereplay.rpc.rollout_wire import (
    event_from_pb,
    prompt_to_pb,
    sampling_to_pb,
    status_from_pb,
    weights_update_from_pb,
)
from routereplay.rpc.security import PLAINTEXT, ClientSecurity, secure_aio_channel, secure_channel
from routereplay.v1 import rollout_pb2, rollout_pb2_grpc

Prompt = str | Sequence[int]


def _generate(
    prompt: Prompt,
    options: SamplingOptions,
    sample_id: str,
    group_id: str,
    return_routes: bool,
    more_turns: bool,
) -> rollout_pb2.GenerateRequest:
    return rollout_pb2.GenerateRequest(
        prompt=prompt_to_pb(prompt),
        sampling=sampling_to_pb(options),
        sample_id=sample_id,
        group_id=group_id,
        return_routes=return_routes,
        more_turns=more_turns,
    )


def _generate_batch(
    prompts: Sequence[Prompt],
    n: int,
    options: SamplingOptions,
    sample_ids: Sequence[str],
    group_ids: Sequence[str],
    return_routes: bool,
    more_turns: bool,
) -> rollout_pb2.GenerateBatchRequest:
    return rollout_pb2.GenerateBatchRequest(
        prompts=[prompt_to_pb(p) for p in prompts],
        n=n,
        sampling=sampling_to_pb(options),
        sample_ids=list(sample_ids),
        group_ids=list(group_ids),
        return_routes=return_routes,
        more_turns=more_turns,
    )


def _continue(
    sample_id: str, prompt: Prompt, options: SamplingOptions, return_routes: bool, final: bool
) -> rollout_pb2.ContinueRequest:
    return rollout_pb2.ContinueRequest(
        sample_id=sample_id,
        prompt=prompt_to_pb(prompt),
        sampling=sampling_to_pb(options),
        return_routes=return_routes,
        final=final,
    )


class RolloutClient:
    """Sync client. Args: target ``host:port``; timeout_s per call (None: no deadline); TLS and
    the bearer token (``routereplay.rpc.security.ClientSecurity``; plaintext by default)."""

    def __init__(
        self, target: str, timeout_s: float | None = 300.0, security: ClientSecurity = PLAINTEXT
    ) -> None:
        self.channel = secure_channel(target, security, channel_options(64 * MIB))
        self.stub = rollout_pb2_grpc.RolloutStub(self.channel)
        self.timeout_s = timeout_s

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _stream(self, call) -> Iterator[SampleEvent]:
        try:
            for response in call:
                yield event_from_pb(response)
        except grpc.RpcError as exc:
            raise domain_error(exc) from None
        finally:
            call.cancel()  # no-op after the end; stops generation if the caller went away

    def _unary(self, method, request, **kwargs):
        try:
            return method(request, timeout=self.timeout_s, **kwargs)
        except grpc.RpcError as exc:
            raise domain_error(exc) from None

    def generate(
        self,
        prompt: Prompt,
        options: SamplingOptions,
        sample_id: str = "",
        group_id: str = "",
        return_routes: bool = False,
        more_turns: bool = False,
    ) -> Iterator[SampleEvent]:
        request = _generate(prompt, options, sample_id, group_id, return_routes, more_turns)
        return self._stream(self.stub.Generate(request, timeout=self.timeout_s))

    def generate_batch(
        self,
        prompts: Sequence[Prompt],
        n: int,
        options: SamplingOptions,
        sample_ids: Sequence[str] = (),
        group_ids: Sequence[str] = (),
        return_routes: bool = False,
        more_turns: bool = False,
    ) -> Iterator[SampleEvent]:
        request = _generate_batch(
            prompts, n, options, sample_ids, group_ids, return_routes, more_turns
        )
        return self._stream(self.stub.GenerateBatch(request, timeout=self.timeout_s))

    def continue_sample(
        self,
        sample_id: str,
        prompt: Prompt,
        options: SamplingOptions,
        return_routes: bool = False,
        final: bool = False,
    ) -> Iterator[SampleEvent]:
        request = _continue(sample_id, prompt, options, return_routes, final)
        return self._stream(self.stub.Continue(request, timeout=self.timeout_s))

    def update_weights(
        self, path: str, policy_version: int = 0, wait_for_ready: bool = False
    ) -> WeightsUpdate:
        """Load the checkpoint at ``path`` (drains running turns first). ``wait_for_ready``:
        wait for a server that is starting instead of failing at once."""
        request = rollout_pb2.UpdateWeightsRequest(path=path, policy_version=policy_version)
        reply = self._unary(self.stub.UpdateWeights, request, wait_for_ready=wait_for_ready)
        return weights_update_from_pb(reply)

    def status(self) -> ServerStatus:
        return status_from_pb(self._unary(self.stub.GetStatus, rollout_pb2.GetStatusRequest()))


class AsyncRolloutClient:
    """Asyncio client, with ``RolloutClient``'s arguments and calls."""

    def __init__(
        self, target: str, timeout_s: float | None = 300.0, security: ClientSecurity = PLAINTEXT
    ) -> None:
        self.channel = secure_aio_channel(target, security, channel_options(64 * MIB))
        self.stub = rollout_pb2_grpc.RolloutStub(self.channel)
        self.timeout_s = timeout_s

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def _stream(self, call) -> AsyncIterator[SampleEvent]:
        try:
            async for response in call:
                yield event_from_pb(response)
        except grpc.RpcError as exc:
            raise domain_error(exc) from None
        finally:
            call.cancel()  # no-op after the end; stops generation if the caller went away

    async def _unary(self, method, request, timeout_s: float | None, **kwargs):
        try:
            return await method(request, timeout=timeout_s, **kwargs)
        except grpc.RpcError as exc:
            raise domain_error(exc) from None

    def generate(
        self,
        prompt: Prompt,
        options: SamplingOptions,
        sample_id: str = "",
        group_id: str = "",
        return_routes: bool = False,
        more_turns: bool = False,
    ) -> AsyncIterator[SampleEvent]:
        request = _generate(prompt, options, sample_id, group_id, return_routes, more_turns)
        return self._stream(self.stub.Generate(request, timeout=self.timeout_s))

    def generate_batch(
        self,
        prompts: Sequence[Prompt],
        n: int,
        options: SamplingOptions,
        sample_ids: Sequence[str] = (),
        group_ids: Sequence[str] = (),
        return_routes: bool = False,
        more_turns: bool = False,
    ) -> AsyncIterator[SampleEvent]:
        request = _generate_batch(
            prompts, n, options, sample_ids, group_ids, return_routes, more_turns
        )
        return self._stream(self.stub.GenerateBatch(request, timeout=self.timeout_s))

    def continue_sample(
        self,
        sample_id: str,
        prompt: Prompt,
        options: SamplingOptions,
        return_routes: bool = False,
        final: bool = False,
    ) -> AsyncIterator[SampleEvent]:
        request = _continue(sample_id, prompt, options, return_routes, final)
        return self._stream(self.stub.Continue(request, timeout=self.timeout_s))

    async def update_weights(
        self, path: str, policy_version: int = 0, wait_for_ready: bool = False
    ) -> WeightsUpdate:
        request = rollout_pb2.UpdateWeightsRequest(path=path, policy_version=policy_version)
        reply = await self._unary(
            self.stub.UpdateWeights, request, self.timeout_s, wait_for_ready=wait_for_ready
        )
        return weights_update_from_pb(reply)

    async def status(self) -> ServerStatus:
        request = rollout_pb2.GetStatusRequest()
        return status_from_pb(await self._unary(self.stub.GetStatus, request, 30))
