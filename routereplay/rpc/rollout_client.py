"""Clients of the Rollout service, sync and asyncio, that speak the domain types.

Events come back as ``SampleDelta`` / ``SampleDone`` / ``SampleFailed``
(``routereplay.domain.rollout``); failed calls raise the domain errors of ``routereplay.errors``.
Both clients share every call (``_RolloutCalls``, through ``routereplay.rpc.transport``) and
differ only in how they wait. No call is retried: a generation must not run twice.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from routereplay.domain.rollout import SampleEvent, SamplingOptions, ServerStatus, WeightsUpdate
from routereplay.rpc.grpc_server import MIB, channel_options
from routereplay.rpc.rollout_wire import (
    event_from_pb,
    prompt_to_pb,
    sampling_to_pb,
    status_from_pb,
    weights_update_from_pb,
)
from routereplay.rpc.security import PLAINTEXT, ClientSecurity, secure_aio_channel, secure_channel
from routereplay.rpc.transport import NO_RETRY, AsyncIO, Blocking, Stream, Unary
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


# The call table. A status is quick to answer: it does not wait a whole generation's deadline.
GENERATE = Stream("Generate", lambda: event_from_pb, retried=False)
GENERATE_BATCH = Stream("GenerateBatch", lambda: event_from_pb, retried=False)
CONTINUE = Stream("Continue", lambda: event_from_pb, retried=False)
UPDATE_WEIGHTS = Unary("UpdateWeights", weights_update_from_pb, retried=False)
STATUS = Unary("GetStatus", status_from_pb, retried=False)
STATUS_TIMEOUT_S = 30.0


class _RolloutCalls:
    """The Rollout service's calls, written once. ``RolloutClient`` returns the values and
    event iterators; ``AsyncRolloutClient`` awaitables and async iterators."""

    _transport_of: type[Blocking] | type[AsyncIO]

    def __init__(
        self, target: str, timeout_s: float | None = 300.0, security: ClientSecurity = PLAINTEXT
    ) -> None:
        self.channel = self._open_channel(target, security, channel_options(64 * MIB))
        self.stub = rollout_pb2_grpc.RolloutStub(self.channel)
        self.transport = self._transport_of(self.stub, NO_RETRY)
        self.timeout_s = timeout_s

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
        return self.transport.stream(GENERATE, request, self.timeout_s)

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
        return self.transport.stream(GENERATE_BATCH, request, self.timeout_s)

    def continue_sample(
        self,
        sample_id: str,
        prompt: Prompt,
        options: SamplingOptions,
        return_routes: bool = False,
        final: bool = False,
    ) -> Iterator[SampleEvent]:
        request = _continue(sample_id, prompt, options, return_routes, final)
        return self.transport.stream(CONTINUE, request, self.timeout_s)

    def update_weights(
        self, path: str, policy_version: int = 0, wait_for_ready: bool = False
    ) -> WeightsUpdate:
        """Load the checkpoint at ``path`` (drains running turns first). ``wait_for_ready``:
        wait for a server that is starting instead of failing at once."""
        request = rollout_pb2.UpdateWeightsRequest(path=path, policy_version=policy_version)
        return self.transport.unary(
            UPDATE_WEIGHTS, request, self.timeout_s, wait_for_ready=wait_for_ready
        )

    def status(self) -> ServerStatus:
        timeout = min(self.timeout_s or STATUS_TIMEOUT_S, STATUS_TIMEOUT_S)
        return self.transport.unary(STATUS, rollout_pb2.GetStatusRequest(), timeout)


class RolloutClient(_RolloutCalls):
    """Sync client. Args: target ``host:port``; timeout_s per call (None: no deadline); TLS and
    the bearer token (``routereplay.rpc.security.ClientSecurity``; plaintext by default)."""

    _transport_of = Blocking
    _open_channel = staticmethod(secure_channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class AsyncRolloutClient(_RolloutCalls):
    """Asyncio client, with ``RolloutClient``'s arguments and calls: each returns an awaitable,
    and the generation calls an async iterator of events."""

    _transport_of = AsyncIO
    _open_channel = staticmethod(secure_aio_channel)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> AsyncRolloutClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()
