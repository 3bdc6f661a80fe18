"""Protobuf at the edge: ``routereplay.v1.rollout`` messages to domain types and back."""

from __future__ import annotations

import numpy as np

from rollout_server.engine import SamplingOptions
from rollout_server.samples import SampleDelta, SampleDone, SampleEvent, SampleFailed
from routereplay.errors import InvalidArgument
from routereplay.v1 import record_pb2, rollout_pb2
from routereplay.wire import geometry_to_pb, tokens_from_pb, turn_to_pb

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
