"""An asyncio client of the Rollout service that speaks the domain types.

Events come back as ``SampleDelta`` / ``SampleDone`` / ``SampleFailed`` (see
``rollout_server.samples``); failed calls raise the domain errors of ``routereplay.errors``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

import grpc
import numpy as np

from rollout_server.engine import SamplingOptions, TokenDelta
from rollout_server.samples import SampleDelta, SampleDone, SampleEvent, SampleFailed
from routereplay.client import domain_error
from routereplay.grpc_server import MIB, channel_options
from routereplay.record import route_dtype
from routereplay.security import PLAINTEXT, ClientSecurity, secure_aio_channel
from routereplay.v1 import rollout_pb2, rollout_pb2_grpc
from routereplay.wire import geometry_from_pb, tokens_from_pb, turn_from_pb


def prompt_to_pb(prompt: str | Sequence[int]) -> rollout_pb2.Prompt:
    if isinstance(prompt, str):
        return rollout_pb2.Prompt(text=prompt)
    return rollout_pb2.Prompt(token_ids=np.asarray(prompt, "<i4").tobytes())


def sampling_to_pb(options: SamplingOptions) -> rollout_pb2.SamplingParams:
    return rollout_pb2.SamplingParams(
        temperature=options.temperature,
        top_p=options.top_p,
        top_k=options.top_k,
        max_tokens=options.max_tokens,
        stop=list(options.stop),
        seed=options.seed,
    )


def event_from_pb(response: rollout_pb2.GenerateResponse) -> SampleEvent:
    sid = response.sample_id
    kind = response.WhichOneof("event")
    if kind == "delta":
        d = response.delta
        lps = np.frombuffer(d.logprobs, "<f4").tolist()
        return SampleDelta(sid, TokenDelta(tokens_from_pb(d.token_ids).tolist(), d.text, lps))
    if kind == "error":
        return SampleFailed(sid, response.error.code, response.error.message)
    done = response.done
    routes, row_start, geometry = None, 0, None
    if done.HasField("routes"):
        inline = done.routes
        geometry = geometry_from_pb(inline.geometry)
        shape = (inline.num_rows, geometry.num_moe_layers, geometry.topk)
        dtype = route_dtype(geometry.num_experts).newbyteorder("<")
        routes = np.frombuffer(inline.data, dtype).reshape(shape)
        row_start = inline.row_start
    return SampleDone(
        sample_id=sid,
        group_id=done.group_id,
        finish_reason=done.finish_reason,
        prompt_tokens=done.prompt_tokens,
        generated_tokens=done.generated_tokens,
        num_tokens=done.num_tokens,
        stored=done.stored,
        store_error=done.store_error,
        turn=turn_from_pb(done.turn),
        geometry=geometry,
        routes=routes,
        row_start=row_start,
        cached_tokens=done.cached_tokens,
    )


class RolloutClient:
    """Asyncio client. Args: target ``host:port``; timeout_s per call (None: no deadline);
    TLS and the bearer token (``routereplay.security.ClientSecurity``; plaintext by default)."""

    def __init__(
        self, target: str, timeout_s: float | None = 300.0, security: ClientSecurity = PLAINTEXT
    ) -> None:
        self.channel = secure_aio_channel(target, security, channel_options(64 * MIB))
        self.stub = rollout_pb2_grpc.RolloutStub(self.channel)
        self.timeout_s = timeout_s

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self) -> RolloutClient:
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

    def generate(
        self, prompt: str | Sequence[int], options: SamplingOptions, sample_id: str = "",
        group_id: str = "", return_routes: bool = False, more_turns: bool = False,
    ) -> AsyncIterator[SampleEvent]:  # fmt: skip
        request = rollout_pb2.GenerateRequest(
            prompt=prompt_to_pb(prompt), sampling=sampling_to_pb(options), sample_id=sample_id,
            group_id=group_id, return_routes=return_routes, more_turns=more_turns,
        )  # fmt: skip
        return self._stream(self.stub.Generate(request, timeout=self.timeout_s))

    def generate_batch(
        self, prompts: Sequence[str | Sequence[int]], n: int, options: SamplingOptions,
        sample_ids: Sequence[str] = (), group_ids: Sequence[str] = (),
        return_routes: bool = False, more_turns: bool = False,
    ) -> AsyncIterator[SampleEvent]:  # fmt: skip
        request = rollout_pb2.GenerateBatchRequest(
            prompts=[prompt_to_pb(p) for p in prompts], n=n, sampling=sampling_to_pb(options),
            sample_ids=list(sample_ids), group_ids=list(group_ids), return_routes=return_routes,
            more_turns=more_turns,
        )  # fmt: skip
        return self._stream(self.stub.GenerateBatch(request, timeout=self.timeout_s))

    def continue_sample(
        self, sample_id: str, prompt: str | Sequence[int], options: SamplingOptions,
        return_routes: bool = False, final: bool = False,
    ) -> AsyncIterator[SampleEvent]:  # fmt: skip
        request = rollout_pb2.ContinueRequest(
            sample_id=sample_id, prompt=prompt_to_pb(prompt), sampling=sampling_to_pb(options),
            return_routes=return_routes, final=final,
        )  # fmt: skip
        return self._stream(self.stub.Continue(request, timeout=self.timeout_s))

    async def update_weights(self, path: str, policy_version: int = 0):
        request = rollout_pb2.UpdateWeightsRequest(path=path, policy_version=policy_version)
        try:
            return await self.stub.UpdateWeights(request, timeout=self.timeout_s)
        except grpc.RpcError as exc:
            raise domain_error(exc) from None

    async def status(self) -> rollout_pb2.ServerStatus:
        try:
            return await self.stub.GetStatus(rollout_pb2.GetStatusRequest(), timeout=30)
        except grpc.RpcError as exc:
            raise domain_error(exc) from None
