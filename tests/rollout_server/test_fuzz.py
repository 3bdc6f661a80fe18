"""Bad input at scale: the Rollout RPCs fuzzed with hypothesis.

Against the session's real aio rollout server (the vLLM engine on the tiny model) over real
gRPC, writing to a real route cache. For every fuzzed call the server must answer with a
status or finish the stream (never INTERNAL or UNKNOWN), keep serving, and store nothing
for a sample unless its final message said ``stored``; whatever it stored reads back whole
and valid. ``max_tokens`` is mostly tiny, so accepted requests generate a few tokens.
"""

from __future__ import annotations

import math
import os
import uuid

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st

from routereplay.domain.record import check_sample_id
from routereplay.errors import InvalidArgument, NotFound
from routereplay.v1 import rollout_pb2, rollout_pb2_grpc

FUZZ = settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# Statuses a bad request may get; INTERNAL and UNKNOWN are bugs.
REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}

int32 = st.integers(-(2**31), 2**31 - 1)
uint64 = st.integers(0, 2**64 - 1)
floats = st.one_of(st.floats(width=32), st.sampled_from([0.0, 0.5, 1.0, -1.0]))
texts = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=200),
    st.from_regex(r"[!-z|~]{1,20}", fullmatch=True),
)
fresh_ids = st.builds(lambda: f"fz-{uuid.uuid4().hex[:16]}")
# Valid values come up as often as random ones, so that accepted requests (which generate,
# store and must read back) are a good part of every run.
sample_ids = st.one_of(fresh_ids, fresh_ids, st.just(""), texts)


@pytest.fixture(scope="module")
def fuzz_target(rollout, loop):
    """An aio channel to the session's rollout server (on the engine's loop)."""
    server, _ = rollout

    async def open_channel():
        return grpc.aio.insecure_channel(f"127.0.0.1:{server.port}")

    channel = loop.run_until_complete(open_channel())
    yield rollout_pb2_grpc.RolloutStub(channel), channel, server
    loop.run_until_complete(channel.close())


def call(loop, method, request):
    """Every message of the call, or its refusal; a bug status fails the test."""

    async def run():
        try:
            reply = method(request, timeout=120)
            if hasattr(reply, "__aiter__"):
                reply = [m async for m in reply]
            else:
                reply = await reply
        except grpc.RpcError as exc:
            assert exc.code() in REFUSALS, (exc.code(), exc.details())
            assert exc.details(), "a refusal must say what was wrong"
            return exc.code(), None
        return grpc.StatusCode.OK, reply

    return loop.run_until_complete(run())


def assert_alive(loop, channel) -> None:
    async def check():
        stub = health_pb2_grpc.HealthStub(channel)
        return await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)

    assert loop.run_until_complete(check()).status == health_pb2.HealthCheckResponse.SERVING


def valid_id(sample_id: str) -> bool:
    try:
        check_sample_id(sample_id)
        return True
    except InvalidArgument:
        return False


def stored_before(cache_reader, asked) -> set[str]:
    """The valid ids among ``asked`` that already have a record."""
    found = set()
    for sample_id in filter(valid_id, asked):
        try:
            cache_reader.stat(sample_id)
            found.add(sample_id)
        except NotFound:
            pass
    return found


def assert_stored_only_when_acknowledged(cache_reader, asked, replies, before=()) -> None:
    """A sample the server said it stored reads back whole and valid; an asked-for id it did
    not report stored (refused call, failed sample) and that had no record ``before`` the call
    has none now."""
    stored = set()
    for reply in replies or []:
        kind = reply.WhichOneof("event")
        if kind == "error":
            assert reply.error.code not in ("INTERNAL", "UNKNOWN"), reply.error
        if kind == "done" and reply.done.stored:
            record = cache_reader.read(reply.sample_id)  # checksums verified on read
            record.validate()  # expert ids in range and distinct, turns partition the tokens
            assert record.num_tokens == reply.done.num_tokens
            stored.add(reply.sample_id)
    for sample_id in asked:
        if valid_id(sample_id) and sample_id not in stored and sample_id not in before:
            with pytest.raises(NotFound):
                cache_reader.stat(sample_id)


def valid_prompts():
    return st.one_of(
        st.builds(rollout_pb2.Prompt, text=st.sampled_from(["Hello", "Tell me a story.", "1 2"])),
        st.builds(
            rollout_pb2.Prompt,
            token_ids=st.lists(st.integers(0, 200), min_size=1, max_size=8).map(
                lambda ids: np.asarray(ids, "<i4").tobytes()
            ),
        ),
    )


def prompts():
    valid = valid_prompts()
    token_bytes = st.one_of(
        st.binary(max_size=40),  # any length: not a multiple of 4, negative or huge ids
        st.lists(st.integers(0, 200), min_size=1, max_size=8).map(
            lambda ids: np.asarray(ids, "<i4").tobytes()
        ),
    )
    return st.one_of(
        valid,
        valid,
        st.just(rollout_pb2.Prompt()),
        st.builds(rollout_pb2.Prompt, text=texts),
        st.builds(rollout_pb2.Prompt, token_ids=token_bytes),
    )


def samplings():
    valid = st.builds(
        rollout_pb2.SamplingParams,
        max_tokens=st.integers(1, 3),
        temperature=st.floats(0, 2),
        top_p=st.floats(0.05, 1),
        top_k=st.integers(0, 50),
    )
    return st.one_of(valid, valid, random_samplings())


@st.composite
def random_samplings(draw):
    params = rollout_pb2.SamplingParams(
        max_tokens=draw(st.one_of(st.integers(-2, 3), int32)),
        stop=draw(st.lists(texts, max_size=2)),
    )
    for name in ("temperature", "top_p"):
        if draw(st.booleans()):
            setattr(params, name, draw(floats))
    if draw(st.booleans()):
        params.top_k = draw(st.one_of(st.integers(-3, 50), int32))
    if draw(st.booleans()):
        params.seed = draw(uint64)
    return params


@FUZZ
@given(
    prompt=prompts(),
    sampling=samplings(),
    sample_id=sample_ids,
    group_id=st.one_of(st.just(""), texts),
    return_routes=st.booleans(),
)
def test_generate(
    fuzz_target, loop, cache_reader, prompt, sampling, sample_id, group_id, return_routes
):
    stub, channel, _ = fuzz_target
    request = rollout_pb2.GenerateRequest(
        prompt=prompt,
        sampling=sampling,
        sample_id=sample_id,
        group_id=group_id,
        return_routes=return_routes,
    )
    before = stored_before(cache_reader, [sample_id])
    code, replies = call(loop, stub.Generate, request)
    event(code.name)  # the mix of answers: --hypothesis-show-statistics
    if code == grpc.StatusCode.OK:
        assert replies[-1].WhichOneof("event") == "done"
    assert_stored_only_when_acknowledged(cache_reader, [sample_id], replies, before)
    assert_alive(loop, channel)


@FUZZ
@given(
    prompts=st.one_of(
        st.lists(valid_prompts(), min_size=1, max_size=3), st.lists(prompts(), max_size=3)
    ),
    n=st.one_of(st.integers(1, 2), st.integers(-2, 3), int32),
    sampling=samplings(),
    ids=st.one_of(st.just([]), st.just([]), st.lists(sample_ids, max_size=4)),
    group_ids=st.one_of(
        st.just([]), st.just([]), st.lists(st.one_of(fresh_ids, texts), max_size=3)
    ),
)
def test_generate_batch(fuzz_target, loop, cache_reader, prompts, n, sampling, ids, group_ids):
    stub, channel, _ = fuzz_target
    request = rollout_pb2.GenerateBatchRequest(
        prompts=prompts, n=n, sampling=sampling, sample_ids=ids, group_ids=group_ids
    )
    before = stored_before(cache_reader, ids)
    code, replies = call(loop, stub.GenerateBatch, request)
    event(code.name)
    assert_stored_only_when_acknowledged(cache_reader, ids, replies, before)
    assert_alive(loop, channel)


@pytest.fixture(scope="module")
def stored_samples(fuzz_target, loop):
    """Three samples generated and stored, for Continue to extend."""
    stub = fuzz_target[0]
    ids = [f"fz-{uuid.uuid4().hex[:16]}" for _ in range(3)]
    for sample_id in ids:
        request = rollout_pb2.GenerateRequest(
            prompt=rollout_pb2.Prompt(text="Hello"),
            sampling=rollout_pb2.SamplingParams(max_tokens=2),
            sample_id=sample_id,
        )
        code, replies = call(loop, stub.Generate, request)
        assert code == grpc.StatusCode.OK and replies[-1].done.stored
    return ids


@FUZZ
@given(prompt=prompts(), sampling=samplings(), which=st.one_of(st.integers(0, 2), sample_ids))
def test_continue(fuzz_target, loop, cache_reader, stored_samples, prompt, sampling, which):
    stub, channel, _ = fuzz_target
    sample_id = stored_samples[which] if isinstance(which, int) else which
    before = None
    if valid_id(sample_id):
        try:
            before = cache_reader.read(sample_id)
        except NotFound:
            pass
    request = rollout_pb2.ContinueRequest(sample_id=sample_id, prompt=prompt, sampling=sampling)
    code, replies = call(loop, stub.Continue, request)
    event(code.name)
    if code == grpc.StatusCode.OK:
        assert replies[-1].WhichOneof("event") == "done"
        assert_stored_only_when_acknowledged(cache_reader, [], replies)
    else:
        if before is None:  # nothing was stored: nothing may appear
            assert_stored_only_when_acknowledged(cache_reader, [sample_id], None)
        else:  # a refused turn leaves the record as it was
            after = cache_reader.read(sample_id)
            np.testing.assert_array_equal(after.token_ids, before.token_ids)
    assert_alive(loop, channel)


@FUZZ
@given(path=texts, version=uint64)
def test_update_weights(fuzz_target, loop, path, version):
    assume(not os.path.exists(path))  # an existing folder could hold real weights
    stub, channel, server = fuzz_target
    before = server.rollout.policy_version
    request = rollout_pb2.UpdateWeightsRequest(path=path, policy_version=version)
    code, _ = call(loop, stub.UpdateWeights, request)
    event(code.name)
    assert code != grpc.StatusCode.OK
    assert server.rollout.policy_version == before
    assert_alive(loop, channel)


def test_continue_a_stored_sample_with_bad_turns(fuzz_target, loop, cache_reader):
    """Refused later turns of a real stored sample leave its record unchanged."""
    stub, channel, _ = fuzz_target
    sample_id = f"fz-{uuid.uuid4().hex[:16]}"
    first = rollout_pb2.GenerateRequest(
        prompt=rollout_pb2.Prompt(text="Hello"),
        sampling=rollout_pb2.SamplingParams(max_tokens=3, temperature=0.0),
        sample_id=sample_id,
    )
    code, replies = call(loop, stub.Generate, first)
    assert code == grpc.StatusCode.OK and replies[-1].done.stored
    before = cache_reader.read(sample_id)
    bad = [
        rollout_pb2.SamplingParams(max_tokens=0),
        rollout_pb2.SamplingParams(max_tokens=10**6),
        rollout_pb2.SamplingParams(max_tokens=2, top_p=0.0),
        rollout_pb2.SamplingParams(max_tokens=2, temperature=-1.0),
        rollout_pb2.SamplingParams(max_tokens=2, top_k=-7),
    ]
    for sampling in bad:
        request = rollout_pb2.ContinueRequest(
            sample_id=sample_id, prompt=rollout_pb2.Prompt(text=" more"), sampling=sampling
        )
        code, _ = call(loop, stub.Continue, request)
        assert code == grpc.StatusCode.INVALID_ARGUMENT, sampling
        after = cache_reader.read(sample_id)
        np.testing.assert_array_equal(after.token_ids, before.token_ids)
        np.testing.assert_array_equal(after.routes, before.routes)
    bad_ids = rollout_pb2.Prompt(token_ids=np.asarray([1, -5], "<i4").tobytes())
    request = rollout_pb2.ContinueRequest(
        sample_id=sample_id, prompt=bad_ids, sampling=rollout_pb2.SamplingParams(max_tokens=2)
    )
    assert call(loop, stub.Continue, request)[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert_alive(loop, channel)


@pytest.mark.parametrize("temperature", [math.nan, math.inf, 2.5])
def test_temperature_vllm_refuses_is_refused_as_invalid(fuzz_target, loop, temperature):
    stub, channel, _ = fuzz_target
    sample_id = f"fz-{uuid.uuid4().hex[:16]}"
    request = rollout_pb2.GenerateRequest(
        prompt=rollout_pb2.Prompt(text="Hello"),
        sampling=rollout_pb2.SamplingParams(max_tokens=2, temperature=temperature),
        sample_id=sample_id,
    )
    assert call(loop, stub.Generate, request)[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert_alive(loop, channel)
