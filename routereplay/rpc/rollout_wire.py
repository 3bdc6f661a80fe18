"""The Rollout contract's conversions, both ways: ``rollout.proto``'s messages (``rollout_pb2``)
to the domain types of ``routereplay.domain.rollout`` and back (the server's edge and the
clients')."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import numpy as np

from routereplay.domain.record import route_dtype
from routereplay.domain.rollout import (
    SampleDelta,
    SampleDone,
    SampleEvent,
    SampleFailed,
    SamplingOptions,
    ServerStatus,
    TokenDelta,
    WeightsUpdate,
)
from routereplay.errors import InvalidArgument
from routereplay.rpc.wire import (
    geometry_from_pb,
    geometry_to_pb,
    tokens_from_pb,
    turn_from_pb,
    turn_to_pb,
)
from routereplay.v1 import record_pb2, rollout_pb2

_DTYPES = {1: record_pb2.ROUTE_DTYPE_UINT8, 2: record_pb2.ROUTE_DTYPE_UINT16}


def prompt_from_pb(prompt: rollout_pb2.Prompt, name: str) -> str | list[int]:
    """Text, or token ids (int32 little-endian bytes)."""
    kind = prompt.WhichOneof("kind")
    if kind is None:
        raise InvalidArgument(f"{name} is empty: set text or token_ids")
    if kind == "text":
        return prompt.text
    return tokens_from_pb(prompt.token_ids, f"{name}.token_ids").tolist()


def sampling_from_pb(params: rollout_pb2.SamplingParams) -> SamplingOptions:
    """Unset optional fields take their defaults; logprobs are always returned."""
    return SamplingOptions(
        temperature=params.temperature if params.HasField("temperature") else 1.0,
        top_p=params.top_p if params.HasField("top_p") else 1.0,
        top_k=params.top_k if params.HasField("top_k") else 0,
        max_tokens=params.max_tokens,
        stop=list(params.stop),
        seed=params.seed if params.HasField("seed") else None,
        logprobs=True,
    )


def event_to_pb(event: SampleEvent) -> rollout_pb2.GenerateResponse:
    if isinstance(event, SampleDelta):
        delta = event.delta
        return rollout_pb2.GenerateResponse(
            sample_id=event.sample_id,
            delta=rollout_pb2.TokenDelta(
                token_ids=np.asarray(delta.token_ids, "<i4").tobytes(),
                text=delta.text,
                logprobs=np.asarray(delta.logprobs, "<f4").tobytes(),
            ),
        )
    if isinstance(event, SampleFailed):
        return rollout_pb2.GenerateResponse(
            sample_id=event.sample_id,
            error=rollout_pb2.SampleError(code=event.code, message=event.message),
        )
    return rollout_pb2.GenerateResponse(sample_id=event.sample_id, done=_done_to_pb(event))


def _done_to_pb(done: SampleDone) -> rollout_pb2.SampleDone:
    pb = rollout_pb2.SampleDone(
        finish_reason=done.finish_reason,
        group_id=done.group_id,
        prompt_tokens=done.prompt_tokens,
        generated_tokens=done.generated_tokens,
        num_tokens=done.num_tokens,
        stored=done.stored,
        store_error=done.store_error,
        turn=turn_to_pb(done.turn),
        cached_tokens=done.cached_tokens,
    )
    if done.routes is not None:
        routes = done.routes
        pb.routes.CopyFrom(
            rollout_pb2.InlineRoutes(
                geometry=geometry_to_pb(done.geometry),
                row_start=done.row_start,
                num_rows=routes.shape[0],
                dtype=_DTYPES[routes.dtype.itemsize],
                data=np.ascontiguousarray(routes, routes.dtype.newbyteorder("<")).tobytes(),
            )
        )
    return pb


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


def weights_update_to_pb(update: WeightsUpdate) -> rollout_pb2.UpdateWeightsResponse:
    return rollout_pb2.UpdateWeightsResponse(
        policy_version=update.policy_version,
        drain_seconds=update.drain_seconds,
        load_seconds=update.load_seconds,
    )


def weights_update_from_pb(pb: rollout_pb2.UpdateWeightsResponse) -> WeightsUpdate:
    return WeightsUpdate(pb.policy_version, pb.drain_seconds, pb.load_seconds)


def status_to_pb(status: ServerStatus) -> rollout_pb2.ServerStatus:
    return rollout_pb2.ServerStatus(
        geometry=geometry_to_pb(status.geometry),
        policy_version=status.policy_version,
        max_model_len=status.max_model_len,
        running=status.running,
        pending_writes=status.pending_writes,
        max_pending_writes=status.max_pending_writes,
        counters=status.counters,
    )


def status_from_pb(pb: rollout_pb2.ServerStatus) -> ServerStatus:
    return ServerStatus(
        geometry=geometry_from_pb(pb.geometry),
        policy_version=pb.policy_version,
        max_model_len=pb.max_model_len,
        running=pb.running,
        pending_writes=pb.pending_writes,
        max_pending_writes=pb.max_pending_writes,
        counters=Counter(pb.counters),
    )
