"""The RouteCache service over real gRPC sockets, on a real single node and a real cluster."""

from __future__ import annotations

import asyncio

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from routereplay.dev.synthetic import synthetic_record, synthetic_routes
from routereplay.domain.codec import Encoding, split_layers
from routereplay.domain.record import Missing, Turn, TurnAppend
from routereplay.errors import AlreadyExists, FailedPrecondition, NotFound
from routereplay.rpc.client import AsyncRouteCacheClient, RouteCacheClient
from routereplay.v1 import record_pb2, route_cache_pb2, route_cache_pb2_grpc
from tests.route_cache.conftest import SMALL, WIDE, as_messages, raw_keys
from tests.support.records import encode_routes, write_requests


def assert_same(got, want):
    assert got.sample_id == want.sample_id and got.group_id == want.group_id
    assert got.geometry == want.geometry
    np.testing.assert_array_equal(got.token_ids, want.token_ids)
    np.testing.assert_array_equal(got.routes, want.routes)
    assert len(got.turns) == len(want.turns)
    for a, b in zip(got.turns, want.turns, strict=True):
        assert (a.token_start, a.token_end, a.generated_start, a.policy_version) == (
            b.token_start,
            b.token_end,
            b.generated_start,
            b.policy_version,
        )
        np.testing.assert_array_equal(a.logprobs, b.logprobs)


@pytest.mark.parametrize("geometry", [SMALL, WIDE], ids=["uint8", "uint16"])
@pytest.mark.parametrize("encoding", list(Encoding))
def test_round_trip(cache, rng, sid, geometry, encoding):
    client, _ = cache
    client.encoding = encoding
    # 3 MiB of routes: several 1 MiB chunks each way.
    record = synthetic_record(sid(), geometry, 20000, rng, skew=1.0, group_id="g")
    result = client.write(record)
    assert (result.num_rows, result.num_tokens, result.duplicate) == (19999, 20000, False)
    assert_same(client.read(record.sample_id), record)
    assert client.write(record).duplicate is True


def test_one_token_record_has_no_rows(cache, rng, sid):
    client, _ = cache
    record = synthetic_record(sid(), SMALL, 1, rng, prompt_tokens=1)
    client.write(record)
    assert_same(client.read(record.sample_id), record)


def test_batch_read_in_order_and_missing(cache, rng, sid):
    client, _ = cache
    records = [synthetic_record(sid(), SMALL, int(n), rng) for n in rng.integers(2, 3000, 6)]
    for record in records:
        client.write(record)
    ids = [r.sample_id for r in records]
    for got, want in zip(client.read_batch(ids[::-1]), records[::-1], strict=True):
        assert_same(got, want)
    absent = sid("absent")
    with pytest.raises(NotFound, match=absent):
        list(client.read_batch([ids[0], absent]))
    got = list(client.read_batch([ids[0], absent, ids[1]], skip_missing=True))
    assert isinstance(got[1], Missing) and got[1].sample_id == absent
    assert_same(got[2], records[1])


def test_multi_turn_equals_single_shot(cache, rng, sid):
    client, _ = cache
    whole = synthetic_record(sid(), SMALL, 40, rng, prompt_tokens=10)
    # Turn 1 is tokens [0, 25): rows [0, 24). Turn 2 adds tokens [25, 40): rows [24, 39).
    lp = whole.turns[0].logprobs
    first = type(whole)(
        whole.sample_id,
        SMALL,
        whole.token_ids[:25],
        whole.routes[:24],
        [Turn(0, 25, 10, 3, lp[:15])],
    )
    client.write(first)
    second = TurnAppend(
        whole.sample_id,
        SMALL,
        24,
        whole.token_ids[25:],
        whole.routes[24:],
        [Turn(25, 40, 30, 4, lp[5:15])],
    )
    assert client.append(second).num_rows == 39
    assert client.append(second).duplicate is True
    got = client.read(whole.sample_id)
    np.testing.assert_array_equal(got.routes, whole.routes)
    np.testing.assert_array_equal(got.token_ids, whole.token_ids)
    assert [(t.token_start, t.token_end, t.policy_version) for t in got.turns] == [
        (0, 25, 3),
        (25, 40, 4),
    ]
    stale = TurnAppend(
        whole.sample_id, SMALL, 24, whole.token_ids[25:], whole.routes[24:], [Turn(25, 40, 30, 9)]
    )
    with pytest.raises(FailedPrecondition, match="has 39 rows"):
        client.append(stale)
    info = client.stat(whole.sample_id)
    assert (info.num_tokens, info.num_rows) == (40, 39)
    assert [t.policy_version for t in info.turns] == [3, 4]
    assert info.route_bytes == whole.routes.nbytes  # RAW: the ids as they are
    assert info.stored_bytes > whole.routes.nbytes and info.ttl_ms > 0


def test_a_write_or_append_of_one_message_is_a_unary_call(cache, rng, sid, monkeypatch):
    """A block that fits in one message goes as a unary call of the same method (no thread
    feeding a request stream); a larger one as a stream. The server takes both as the same
    call, and each record reads back as written."""
    client, _ = cache
    calls = []
    for method in ("WriteRecord", "WriteRecordUnary", "AppendTurn", "AppendTurnUnary"):
        sent = getattr(client.stub, method)
        counted = lambda request, *a, _name=method, _sent=sent, **kw: (  # noqa: E731
            calls.append(_name) or _sent(request, *a, **kw)
        )
        monkeypatch.setattr(client.stub, method, counted)
    client.chunk_bytes = 4096  # a header and 300 rows of SMALL's routes do not fit
    small, large = synthetic_record(sid(), SMALL, 20, rng), synthetic_record(sid(), SMALL, 300, rng)
    client.write(small, more_turns=True)
    client.write(large)
    more = TurnAppend(
        small.sample_id, SMALL, 19, small.token_ids[:5], small.routes[:5], [Turn(20, 25, 20, 1)]
    )
    client.append(more, final=True)
    assert calls == ["WriteRecordUnary", "WriteRecord", "AppendTurnUnary"]
    assert_same(client.read(large.sample_id), large)
    got = client.read(small.sample_id)
    np.testing.assert_array_equal(got.routes, np.concatenate([small.routes, small.routes[:5]]))


@pytest.mark.parametrize("encoding", list(Encoding))
def test_stat_gives_each_blocks_stored_route_bytes(cache, stub, rng, sid, encoding):
    """StatRecord's blocks carry their stored sizes (they came back 0); ``stored_bytes`` is
    Redis's memory for the whole key, far above the route bytes of a small record."""
    client, _ = cache
    client.encoding = encoding
    whole = synthetic_record(sid(), SMALL, 40, rng, prompt_tokens=10)
    lp = whole.turns[0].logprobs
    client.write(
        type(whole)(
            whole.sample_id,
            SMALL,
            whole.token_ids[:25],
            whole.routes[:24],
            [Turn(0, 25, 10, 0, lp[:15])],
        )
    )
    client.append(
        TurnAppend(
            whole.sample_id,
            SMALL,
            24,
            whole.token_ids[25:],
            whole.routes[24:],
            [Turn(25, 40, 30, 1, lp[5:15])],
        )
    )
    stat = stub.StatRecord(route_cache_pb2.StatRecordRequest(sample_id=whole.sample_id))
    # The oracle: each block's routes encoded by the codec, one part per MoE layer.
    want = [
        split_layers(encode_routes(part, encoding), SMALL).sizes
        for part in (whole.routes[:24], whole.routes[24:])
    ]
    assert [tuple(p.size for p in b.layer_parts) for b in stat.blocks] == want
    assert [b.encoded_size for b in stat.blocks] == [sum(sizes) for sizes in want]
    route_bytes = sum(map(sum, want))
    if encoding is Encoding.RAW:  # rows x layers x k ids of one byte
        assert want == [(24 * SMALL.topk,) * 5, (15 * SMALL.topk,) * 5]
    assert client.stat(whole.sample_id).route_bytes == route_bytes
    print(f"{encoding.name}: route bytes {route_bytes}, stored_bytes {stat.stored_bytes}")
    assert stat.stored_bytes > 2 * route_bytes


def test_unknown_sample_is_not_found(cache, sid):
    client, _ = cache
    for call in (client.read, client.stat, client.delete):
        with pytest.raises(NotFound, match="no record for sample_id"):
            call(sid("unknown"))


def test_taken_id_with_other_data_is_already_exists(cache, rng, sid):
    client, _ = cache
    record = synthetic_record(sid(), SMALL, 50, rng)
    client.write(record)
    other = synthetic_record(record.sample_id, SMALL, 50, rng)
    with pytest.raises(AlreadyExists):
        client.write(other)
    assert_same(client.read(record.sample_id), record)


def test_delete(cache, rng, sid):
    client, _ = cache
    record = synthetic_record(sid(), SMALL, 50, rng)
    client.write(record)
    client.delete(record.sample_id)
    with pytest.raises(NotFound):
        client.read(record.sample_id)


def test_async_client(cache, rng, sid):
    _, server = cache
    records = [synthetic_record(sid(), SMALL, 300, rng) for _ in range(3)]

    async def run():
        async with AsyncRouteCacheClient(f"127.0.0.1:{server.port}") as client:
            await asyncio.gather(*(client.write(r) for r in records))
            got = [r async for r in client.read_batch([r.sample_id for r in records])]
            one = await client.read(records[0].sample_id)
            info = await client.stat(records[0].sample_id)
            return got, one, info

    got, one, info = asyncio.run(run())
    for a, b in zip(got, records, strict=True):
        assert_same(a, b)
    assert_same(one, records[0])
    assert info.num_rows == 299


def test_health_and_reflection(cache):
    _, server = cache
    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "routereplay.v1.RouteCache"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        reply = next(stub.ServerReflectionInfo(iter([request]), timeout=5))
        names = {s.name for s in reply.list_services_response.service}
        assert {"routereplay.v1.RouteCache", "grpc.health.v1.Health"} <= names


# --- bad input: crafted streams through the raw stub, so the client cannot fix them ------


@pytest.fixture
def stub(cache):
    _, server = cache
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield route_cache_pb2_grpc.RouteCacheStub(channel)
    channel.close()


def messages(record, encoding=Encoding.RAW, chunk_bytes=512):
    return as_messages(write_requests(record, encode_routes(record.routes, encoding), chunk_bytes))


def refused(stub, requests, code, match):
    with pytest.raises(grpc.RpcError) as info:
        stub.WriteRecord(iter(requests), timeout=10)
    assert info.value.code() == code, info.value.details()
    assert match in info.value.details(), info.value.details()


def valid(rng, sid, tokens=200):
    return synthetic_record(sid(), SMALL, tokens, rng)


INVALID = grpc.StatusCode.INVALID_ARGUMENT


def test_routes_that_disagree_with_the_geometry(stub, rng, sid, redis_client):
    record = valid(rng, sid)
    wrong = synthetic_routes(SMALL, 150, rng)  # 150 rows for 200 tokens
    record.routes = wrong
    refused(stub, messages(record), INVALID, "the tokens need rows [0, 199)")
    record = valid(rng, sid)
    msgs = messages(record)
    msgs[0].header.geometry.topk = 3  # the bytes no longer fit [rows, 5, 3]
    refused(stub, msgs, INVALID, "need")
    assert raw_keys(redis_client, f"*{record.sample_id}*") == []


def test_expert_id_out_of_range(stub, rng, sid):
    record = valid(rng, sid)
    record.routes = record.routes.copy()
    record.routes[17, 2, 1] = 16
    refused(stub, messages(record), INVALID, "routes[17] layer 3: expert id 16 >= num_experts=16")


def test_a_block_of_zeros(stub, rng, sid):
    record = valid(rng, sid)
    record.routes = np.zeros_like(record.routes)
    refused(stub, messages(record), INVALID, "expert ids repeat within the top-k")


def test_wrong_dtype_for_num_experts(stub, rng, sid):
    record = valid(rng, sid)
    msgs = messages(record)
    msgs[0].header.block.dtype = record_pb2.ROUTE_DTYPE_UINT16
    refused(stub, msgs, INVALID, "block.dtype is ROUTE_DTYPE_UINT16")
    msgs[0].header.block.dtype = 3  # a value this version does not know (fuzzing: was INTERNAL)
    refused(stub, msgs, INVALID, "block.dtype is 3")


@pytest.mark.parametrize(
    "sample_id, match",
    [("", "sample_id is empty"), ("x" * 300, "300 characters"), ("a b", "printable")],
)
def test_bad_sample_ids(stub, rng, sid, sample_id, match):
    msgs = messages(valid(rng, sid))
    msgs[0].header.sample_id = sample_id
    refused(stub, msgs, INVALID, match)


def test_chunks_out_of_order_overlapping_or_missing(stub, rng, sid, redis_client):
    record = valid(rng, sid, 400)  # 399 rows x 20 bytes = 7980 bytes: 16 chunks of 512
    msgs = messages(record)
    swapped = msgs[:2] + [msgs[3], msgs[2]] + msgs[4:]
    refused(stub, swapped, INVALID, "out of order or missing")
    refused(stub, msgs[:3] + msgs[2:], INVALID, "overlapping")
    refused(stub, msgs[:3] + msgs[4:], INVALID, "out of order or missing")
    refused(stub, msgs[:-1], INVALID, "stream ended before the chunk marked last")
    refused(stub, msgs[1:], INVALID, "first message of the stream must be the header")
    refused(stub, [msgs[0], msgs[0]], INVALID, "expected a chunk message")
    assert raw_keys(redis_client, f"*{record.sample_id}*") == []


def test_checksum_mismatch(stub, rng, sid):
    msgs = messages(valid(rng, sid))
    data = bytearray(msgs[3].chunk.data)
    data[7] ^= 1
    msgs[3].chunk.data = bytes(data)
    refused(stub, msgs, INVALID, "checksum mismatch")


def test_bad_turns_and_tokens(stub, rng, sid):
    msgs = messages(valid(rng, sid))
    msgs[0].header.turns[0].token_end = 150
    refused(stub, msgs, INVALID, "turns[0].logprobs has 150 values for 100 generated")
    msgs = messages(valid(rng, sid))
    msgs[0].header.token_ids = msgs[0].header.token_ids[:-1]
    refused(stub, msgs, INVALID, "token_ids has 799 bytes")


def test_batch_request_limits(stub):
    with pytest.raises(grpc.RpcError) as info:
        list(stub.ReadBatch(route_cache_pb2.ReadBatchRequest(), timeout=5))
    assert info.value.code() == INVALID and "sample_ids is empty" in info.value.details()
    request = route_cache_pb2.ReadBatchRequest(sample_ids=["ok", "not ok"])
    with pytest.raises(grpc.RpcError) as info:
        list(stub.ReadBatch(request, timeout=5))
    assert info.value.code() == INVALID and "sample_ids[1]" in info.value.details()


def test_redis_down_is_unavailable_and_not_serving(rng, sid):
    """Its own Redis, stopped and restarted on the same port."""
    from route_cache.config import Config
    from route_cache.connection import connect
    from route_cache.server import RouteCacheServer
    from route_cache.store import RouteStore
    from routereplay.dev.redis_nodes import RedisProcess
    from routereplay.errors import Unavailable
    from routereplay.rpc.client import RetryPolicy

    node = RedisProcess().start()
    store = RouteStore(connect(node.url, False, socket_connect_timeout=0.5, socket_timeout=2))
    server = RouteCacheServer(Config(host="127.0.0.1", port=0, health_interval_s=0.1), store)
    server.start()
    target = f"127.0.0.1:{server.port}"
    client = RouteCacheClient(target, retry=RetryPolicy(attempts=1))
    channel = grpc.insecure_channel(target)
    health = health_pb2_grpc.HealthStub(channel)

    def status():
        request = health_pb2.HealthCheckRequest(service="routereplay.v1.RouteCache")
        return health.Check(request, timeout=5).status

    try:
        record = valid(rng, sid)
        client.write(record)
        node.kill()
        with pytest.raises(Unavailable, match="redis is unreachable"):
            client.read(record.sample_id)
        _wait_for(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING)
        node.start()
        _wait_for(lambda: status() == health_pb2.HealthCheckResponse.SERVING)
        client.write(record)  # the node kept nothing on disk: a fresh write
        assert_same(client.read(record.sample_id), record)
    finally:
        client.close()
        channel.close()
        server.stop(0)
        node.stop()


def _wait_for(condition, timeout_s=10.0):
    import time

    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.05)


@pytest.mark.parametrize("split_first", [False, True], ids=["with_header", "own_message"])
def test_the_first_chunk_with_its_header_or_in_its_own_message(stub, cache, rng, sid, split_first):
    """Current clients send a write's first chunk in the header's message; clients before
    ``first_chunk`` sent it as a chunk message of its own. Both store the same record, and
    a chunk of either form out of place is refused."""
    client, _ = cache

    def requests(record):
        encoded = encode_routes(record.routes)
        return as_messages(write_requests(record, encoded, 10000), split_first=split_first)

    record = valid(rng, sid, tokens=1000)
    msgs = requests(record)
    first = msgs[1].chunk if split_first else msgs[0].first_chunk
    assert len(first.data) > 0 and msgs[0].HasField("first_chunk") != split_first
    stub.WriteRecord(iter(msgs), timeout=10)
    assert_same(client.read(record.sample_id), record)
    msgs = requests(valid(rng, sid, tokens=1000))
    del msgs[2 if split_first else 1]  # the chunk after the first one
    refused(stub, msgs, INVALID, "out of order or missing")


@pytest.mark.parametrize("asked", [False, True])
def test_a_read_sends_the_first_chunk_with_the_record_only_when_asked(stub, cache, rng, sid, asked):
    """Readers before ``first_chunk_with_record`` expect the record's message, then its
    chunks; they keep getting that."""
    client, _ = cache
    record = valid(rng, sid, tokens=300)
    client.write(record)
    request = route_cache_pb2.ReadRecordRequest(
        sample_id=record.sample_id, layer_parts=True, first_chunk_with_record=asked
    )
    first, *rest = stub.ReadRecord(request, timeout=10)
    assert first.WhichOneof("part") == "record" and first.HasField("first_chunk") == asked
    assert all(r.WhichOneof("part") == "chunk" for r in rest)
    size = sum(b.encoded_size for b in first.record.blocks)
    chunks = [first.first_chunk] * asked + [r.chunk for r in rest]
    assert sum(len(c.data) for c in chunks) == size and chunks[-1].last
