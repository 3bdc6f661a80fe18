"""Bad input at scale: every RouteCache RPC and the route codec, fuzzed with hypothesis.

Against a real route cache server over real gRPC on real redis-server processes (a single
node, then a 3-master cluster). For every fuzzed call the server must answer with a status
(never INTERNAL or UNKNOWN), keep serving, and store nothing unless it answered OK; whatever
it did store reads back whole and passes validation (expert ids in range and distinct,
checksums).

Bugs it found are fixed, each with a regression test (docs/reliability.md lists them).
Request bytes that are not a message at all are fuzzed in test_security.py.
"""

from __future__ import annotations

import uuid

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from route_cache.config import Config
from route_cache.connection import connect
from route_cache.record_format import record_key
from route_cache.server import RouteCacheServer
from route_cache.store import RouteStore
from routereplay.dev.synthetic import synthetic_record, synthetic_routes
from routereplay.domain.codec import EncodedRoutes, Encoding, checksum, decode_routes
from routereplay.domain.record import Geometry, Turn, TurnAppend
from routereplay.errors import DataLoss, InvalidArgument
from routereplay.rpc.client import RouteCacheClient
from routereplay.v1 import record_pb2, route_cache_pb2, route_cache_pb2_grpc
from tests.route_cache.conftest import SMALL, WIDE, as_messages
from tests.support.records import append_requests, encode_routes, write_requests

FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
# Statuses a bad request may get; INTERNAL and UNKNOWN are bugs.
REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.NOT_FOUND,
    grpc.StatusCode.ALREADY_EXISTS,
    grpc.StatusCode.FAILED_PRECONDITION,
    grpc.StatusCode.DATA_LOSS,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
}

uint32 = st.integers(0, 2**32 - 1)
uint64 = st.integers(0, 2**64 - 1)
small = st.integers(0, 40)
# Any text protobuf can carry (no lone surrogates), plus the alphabet of valid ids.
texts = st.one_of(
    st.text(st.characters(blacklist_categories=("Cs",)), max_size=300),
    st.from_regex(r"[!-z|~]{1,20}", fullmatch=True),
)
entry_ids = st.one_of(
    texts,
    st.integers(0, 2**64 - 1).map(str),
    st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)).map(lambda t: f"{t[0]}-{t[1]}"),
)


@pytest.fixture(scope="module", params=["single", "cluster"])
def server(request, redis_node):
    """A route cache over one Redis node, then over a 3-master Redis Cluster (where a record's
    keys share a hash slot and the ready feed lives in another)."""
    if request.param == "single":
        redis_client = connect(redis_node.url, cluster=False)
    else:
        nodes = request.getfixturevalue("redis_cluster_nodes")
        redis_client = connect(nodes[0].url.rsplit("/", 1)[0], cluster=True)
    store = RouteStore(redis_client, ttl_ms=600_000)
    cache = RouteCacheServer(
        Config(host="127.0.0.1", port=0, grace_s=1, health_interval_s=0.1), store
    ).start()
    channel = grpc.insecure_channel(f"127.0.0.1:{cache.port}")
    client = RouteCacheClient(f"127.0.0.1:{cache.port}", timeout_s=30)
    yield route_cache_pb2_grpc.RouteCacheStub(channel), channel, client, redis_client
    client.close()
    channel.close()
    cache.stop(0)
    redis_client.close()


def fresh_id() -> str:
    return f"fz-{uuid.uuid4().hex[:16]}"


def call(fn, *args):
    """The call's status code (OK or the refusal) and its reply; a bug status fails."""
    try:
        reply = fn(*args, timeout=30)
        if hasattr(reply, "__next__"):
            reply = list(reply)
        return grpc.StatusCode.OK, reply
    except grpc.RpcError as exc:
        assert exc.code() in REFUSALS, (exc.code(), exc.details())
        return exc.code(), None


def assert_alive(server) -> None:
    _, channel, client, _ = server
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    assert health.status == health_pb2.HealthCheckResponse.SERVING


def assert_stored_whole_or_not_at_all(server, sample_id: str, code) -> None:
    """Nothing under ``sample_id`` unless the write was acknowledged; then it reads back valid."""
    _, _, client, redis_client = server
    if code != grpc.StatusCode.OK:
        assert not redis_client.exists(record_key(sample_id)), f"garbage stored for {sample_id}"
        return
    record = client.read(sample_id)  # verifies checksums and decodes
    record.validate()  # ids in range and distinct, turns partition the tokens
    client.delete(sample_id)


# --- WriteRecord ------------------------------------------------------------------------


def geometries():
    return st.builds(
        lambda layers, topk, experts, model: record_pb2.Geometry(
            moe_layers=layers, topk=topk, num_experts=experts, model_id=model
        ),
        st.lists(st.one_of(small, uint32), max_size=6),
        st.one_of(small, uint32),
        st.one_of(st.integers(0, 300), uint32),
        texts,
    )


def turns():
    return st.builds(
        record_pb2.Turn,
        token_start=st.one_of(small, uint32),
        token_end=st.one_of(small, uint32),
        generated_start=st.one_of(small, uint32),
        policy_version=uint64,
        logprobs=st.binary(max_size=64),
    )


def blocks():
    return st.builds(
        record_pb2.RouteBlock,
        row_start=st.one_of(small, uint32),
        num_rows=st.one_of(small, uint32),
        dtype=st.integers(0, 2),  # unknown values: INTERNAL (see the module docstring)
        encoding=st.integers(0, 5),
        encoded_size=st.one_of(st.integers(0, 2000), uint64),
        checksum=uint64,
    )


def chunks():
    return st.builds(
        record_pb2.RouteChunk,
        block=st.one_of(st.just(0), uint32),
        offset=st.one_of(st.integers(0, 2000), uint64),
        data=st.binary(max_size=512),
        last=st.booleans(),
    )


@st.composite
def random_write_streams(draw):
    sample_id = draw(st.one_of(st.just(fresh_id()), texts))
    header = route_cache_pb2.RecordHeader(
        sample_id=sample_id,
        group_id=draw(st.one_of(st.just(""), texts)),
        geometry=draw(st.one_of(geometries(), st.just(None))),
        token_ids=draw(st.binary(max_size=128)),
        turns=draw(st.lists(turns(), max_size=3)),
        block=draw(st.one_of(blocks(), st.just(None))),
    )
    parts = [route_cache_pb2.WriteRecordRequest(header=header)]
    parts += [
        route_cache_pb2.WriteRecordRequest(chunk=c) for c in draw(st.lists(chunks(), max_size=4))
    ]
    order = draw(st.permutations(range(len(parts))))  # the header may come anywhere, or twice
    extra = draw(st.lists(st.sampled_from(parts), max_size=2))
    return sample_id, [parts[i] for i in order] + extra


def _mutate_header(header, what: str, draw) -> None:
    if what == "checksum":
        header.block.checksum = draw(uint64)
    elif what == "num_rows":
        header.block.num_rows = draw(st.one_of(small, uint32))
    elif what == "row_start":
        header.block.row_start = draw(st.one_of(small, uint32))
    elif what == "encoded_size":
        header.block.encoded_size = draw(st.one_of(st.integers(0, 5000), uint64))
    elif what == "dtype":
        header.block.dtype = draw(st.integers(0, 2))
    elif what == "encoding":
        header.block.encoding = draw(st.integers(0, 5))
    elif what == "topk":
        header.geometry.topk = draw(st.one_of(small, uint32))
    elif what == "num_experts":
        header.geometry.num_experts = draw(st.one_of(st.integers(0, 300), uint32))
    elif what == "moe_layers":
        header.geometry.moe_layers[:] = draw(st.lists(small, max_size=7))
    elif what == "token_ids":
        data = bytearray(header.token_ids)
        if data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= draw(st.integers(1, 255))
        header.token_ids = bytes(data[: draw(st.integers(0, len(data)))])
    elif what == "turns":
        header.turns[0].generated_start = draw(st.one_of(small, uint32))
        header.turns[0].logprobs = draw(st.binary(max_size=32))


MUTATIONS = [
    "flip_route_byte",
    "flip_and_rechecksum",
    "truncate",
    "duplicate_chunk",
    "drop_chunk",
    "swap",
    "offset",
    "unmark_last",
    "mark_last_early",
    "chunk_block",
    "checksum",
    "num_rows",
    "row_start",
    "encoded_size",
    "dtype",
    "encoding",
    "topk",
    "num_experts",
    "moe_layers",
    "token_ids",
    "turns",
]


@st.composite
def mutated_streams(draw, kind: str):
    """A valid write (or append) stream of small chunks, then one to three mutations."""
    geometry = draw(st.sampled_from([SMALL, WIDE])) if kind == "write" else kind[2]
    encoding = draw(st.sampled_from([Encoding.RAW, Encoding.ZSTD]))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    tokens = draw(st.integers(2, 200))
    chunk_bytes = draw(st.sampled_from([16, 64, 500, 1 << 20]))
    split_first = draw(st.booleans())  # the first chunk in the header's message, or its own
    if kind == "write":
        sample_id = fresh_id()
        record = synthetic_record(sample_id, geometry, tokens, rng, skew=1.0)
        requests = as_messages(
            write_requests(record, encode_routes(record.routes, encoding), chunk_bytes),
            split_first=split_first,
        )
    else:
        sample_id, base_tokens, _ = kind  # an append to this stored record
        routes = synthetic_routes(geometry, tokens, rng, skew=1.0)
        append = TurnAppend(
            sample_id,
            geometry,
            base_tokens - 1,
            rng.integers(0, 1000, tokens, dtype=np.int32),
            routes,
            [Turn(base_tokens, base_tokens + tokens, base_tokens + 1, 1)],
        )
        encoded = encode_routes(routes, encoding)
        requests = as_messages(
            append_requests(append, encoded, chunk_bytes),
            route_cache_pb2.AppendTurnRequest,
            split_first,
        )
    requests = [type(r).FromString(r.SerializeToString()) for r in requests]  # mutable copies
    for what in draw(st.lists(st.sampled_from(MUTATIONS), min_size=1, max_size=3)):
        chunk_at = [i for i, r in enumerate(requests) if r.WhichOneof("part") == "chunk"]
        header = requests[0].header if requests else None
        if what in ("flip_route_byte", "flip_and_rechecksum"):
            i = draw(st.sampled_from(chunk_at)) if chunk_at else None
            if i is None or not requests[i].chunk.data:
                continue
            data = bytearray(requests[i].chunk.data)
            data[draw(st.integers(0, len(data) - 1))] ^= draw(st.integers(1, 255))
            requests[i].chunk.data = bytes(data)
            if what == "flip_and_rechecksum":
                joined = b"".join(requests[j].chunk.data for j in chunk_at)
                header.block.checksum = checksum(joined)
        elif what == "truncate":
            requests = requests[: draw(st.integers(1, len(requests)))]
        elif (
            what
            in (
                "duplicate_chunk",
                "drop_chunk",
                "offset",
                "unmark_last",
                "mark_last_early",
                "chunk_block",
            )
            and chunk_at
        ):
            i = draw(st.sampled_from(chunk_at))
            if what == "duplicate_chunk":
                requests.insert(i, requests[i])
            elif what == "drop_chunk":
                del requests[i]
            elif what == "offset":
                requests[i].chunk.offset = draw(st.one_of(st.integers(0, 5000), uint64))
            elif what == "unmark_last":
                requests[i].chunk.last = False
            elif what == "mark_last_early":
                requests[i].chunk.last = True
            else:
                requests[i].chunk.block = draw(st.integers(1, 2**32 - 1))
        elif what == "swap" and len(requests) > 1:
            i, j = draw(st.lists(st.integers(0, len(requests) - 1), min_size=2, max_size=2))
            requests[i], requests[j] = requests[j], requests[i]
        elif requests and requests[0].WhichOneof("part") == "header":
            _mutate_header(header, what, draw)
    return sample_id, requests


def test_write_record_random_messages(server):
    stub = server[0]

    @FUZZ
    @given(random_write_streams())
    def check(case):
        sample_id, requests = case
        code, _ = call(stub.WriteRecord, iter(requests))
        if sample_id.startswith("fz-"):
            assert_stored_whole_or_not_at_all(server, sample_id, code)

    check()
    assert_alive(server)


def test_write_record_mutated_streams(server):
    stub = server[0]
    codes = {}

    @settings(FUZZ, max_examples=100)
    @given(mutated_streams("write"))
    def check(case):
        sample_id, requests = case
        code, _ = call(stub.WriteRecord, iter(requests))
        codes[code] = codes.get(code, 0) + 1
        assert_stored_whole_or_not_at_all(server, sample_id, code)

    check()
    assert_alive(server)
    assert grpc.StatusCode.INVALID_ARGUMENT in codes


# --- AppendTurn -------------------------------------------------------------------------


@st.composite
def random_append_streams(draw):
    header = route_cache_pb2.AppendHeader(
        sample_id=draw(texts),
        geometry=draw(st.one_of(geometries(), st.just(None))),
        row_offset=draw(st.one_of(small, uint32)),
        token_ids=draw(st.binary(max_size=128)),
        turns=draw(st.lists(turns(), max_size=3)),
        block=draw(st.one_of(blocks(), st.just(None))),
    )
    parts = [route_cache_pb2.AppendTurnRequest(header=header)]
    parts += [
        route_cache_pb2.AppendTurnRequest(chunk=c) for c in draw(st.lists(chunks(), max_size=4))
    ]
    return [parts[i] for i in draw(st.permutations(range(len(parts))))]


def test_append_turn_random_messages(server):
    stub = server[0]

    @FUZZ
    @given(random_append_streams())
    def check(requests):
        call(stub.AppendTurn, iter(requests))

    check()
    assert_alive(server)


@pytest.mark.parametrize("geometry", [SMALL, WIDE], ids=["uint8", "uint16"])
def test_append_turn_mutated_streams(server, geometry):
    """Appends to a stored record: refused ones leave it exactly as it was."""
    _, _, client, _ = server
    rng = np.random.default_rng(11)

    @settings(FUZZ, max_examples=50)
    @given(st.data())
    def check(data):
        base = synthetic_record(fresh_id(), geometry, 30, rng)
        client.write(base)
        sample_id, requests = data.draw(
            mutated_streams((base.sample_id, base.num_tokens, geometry))
        )
        code, _ = call(server[0].AppendTurn, iter(requests))
        got = client.read(sample_id)
        got.validate()
        if code != grpc.StatusCode.OK:
            np.testing.assert_array_equal(got.routes, base.routes)
            np.testing.assert_array_equal(got.token_ids, base.token_ids)
        else:
            np.testing.assert_array_equal(got.routes[: base.num_rows], base.routes)
        client.delete(sample_id)

    check()
    assert_alive(server)


# --- Reads, stat, delete ----------------------------------------------------------------


def test_read_stat_delete_random_ids(server):
    stub = server[0]

    @FUZZ
    @given(texts, st.lists(texts, max_size=5), st.booleans())
    def check(sample_id, batch, skip_missing):
        call(stub.ReadRecord, route_cache_pb2.ReadRecordRequest(sample_id=sample_id))
        call(stub.StatRecord, route_cache_pb2.StatRecordRequest(sample_id=sample_id))
        call(stub.DeleteRecord, route_cache_pb2.DeleteRecordRequest(sample_id=sample_id))
        request = route_cache_pb2.ReadBatchRequest(sample_ids=batch, skip_missing=skip_missing)
        call(stub.ReadBatch, request)

    check()
    assert_alive(server)


def test_read_batch_bounds(server):
    stub, _, client, _ = server
    record = synthetic_record(fresh_id(), SMALL, 50, np.random.default_rng(3))
    client.write(record)
    too_many = route_cache_pb2.ReadBatchRequest(sample_ids=[record.sample_id] * 1025)
    assert call(stub.ReadBatch, too_many)[0] == grpc.StatusCode.INVALID_ARGUMENT
    mixed = route_cache_pb2.ReadBatchRequest(sample_ids=[record.sample_id, "fz-none"])
    assert call(stub.ReadBatch, mixed)[0] == grpc.StatusCode.NOT_FOUND
    mixed.skip_missing = True
    code, replies = call(stub.ReadBatch, mixed)
    assert code == grpc.StatusCode.OK and replies[-1].missing_sample_id == "fz-none"
    client.delete(record.sample_id)


# --- The ready feed -------------------------------------------------------------------


def test_read_ready_random_requests(server):
    stub = server[0]

    @FUZZ
    @given(
        st.builds(
            route_cache_pb2.ReadReadyRequest,
            consumer_group=st.one_of(texts, st.just("fz-group")),
            consumer=texts,
            max_entries=st.one_of(st.integers(0, 3), uint32),
            # Long waits are refused (over the limit) or kept short: no idle blocking here.
            block_ms=st.one_of(st.integers(0, 20), st.integers(10_001, 2**32 - 1)),
            pending_cursor=st.one_of(st.just(""), entry_ids),
            claim_idle_ms=st.one_of(st.just(0), uint32),
            claim_cursor=st.one_of(st.just(""), entry_ids),
            start_from_latest=st.booleans(),
        )
    )
    def check(request):
        call(stub.ReadReady, request)

    check()
    assert_alive(server)


def test_ack_ready_random_requests(server):
    stub = server[0]

    @FUZZ
    @given(
        st.one_of(texts, st.just("fz-group")),
        st.lists(entry_ids, max_size=5),
        st.lists(texts, max_size=5),  # sample_ids
        st.lists(texts, max_size=3),  # dead_letter_ids (issue 47)
        texts,  # dead_letter_reason
    )
    def check(group, ids, samples, dead, reason):
        request = route_cache_pb2.AckReadyRequest(
            consumer_group=group,
            entry_ids=ids,
            consumer="fz",
            sample_ids=samples,
            dead_letter_ids=dead,
            dead_letter_reason=reason,
        )
        call(stub.AckReady, request)

    check()
    assert_alive(server)


def test_still_serves_after_fuzzing(server):
    _, _, client, _ = server
    assert_alive(server)
    record = synthetic_record(fresh_id(), SMALL, 300, np.random.default_rng(5))
    assert client.write(record).num_rows == 299
    np.testing.assert_array_equal(client.read(record.sample_id).routes, record.routes)
    client.delete(record.sample_id)


# --- The codec --------------------------------------------------------------------------

valid_geometries = st.builds(
    lambda layers, topk, experts: Geometry(tuple(sorted(set(layers))), topk, experts),
    st.lists(st.integers(0, 60), min_size=1, max_size=6),
    st.integers(1, 8),
    st.sampled_from([8, 16, 128, 256, 257, 300, 65536]),
).filter(lambda g: g.topk <= g.num_experts)


def _decode(encoded: EncodedRoutes, geometry: Geometry) -> None:
    try:
        routes = decode_routes(encoded, geometry)
    except (InvalidArgument, DataLoss):
        return
    assert routes.shape == (encoded.num_rows, geometry.num_moe_layers, geometry.topk)
    assert routes.dtype == geometry.dtype


@settings(max_examples=300, deadline=None)
@given(
    valid_geometries,
    st.sampled_from(list(Encoding)),
    st.binary(max_size=2000),
    st.integers(0, 100),
    st.booleans(),
)
def test_decode_random_bytes(geometry, encoding, data, rows, good_checksum):
    sum_ = checksum(data) if good_checksum else checksum(data) ^ 1
    _decode(EncodedRoutes(encoding, data, sum_, rows), geometry)


@settings(max_examples=300, deadline=None)
@given(valid_geometries, st.integers(1, 60), st.data())
def test_decode_mutated_zstd(geometry, rows, data):
    """A valid ZSTD block, flipped or cut, with its checksum recomputed: refused or decoded to
    the right shape, never another exception."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    routes = synthetic_routes(geometry, rows, rng, skew=1.5)
    encoded = encode_routes(routes, Encoding.ZSTD)
    block = bytearray(encoded.data)
    for _ in range(data.draw(st.integers(1, 4))):
        if block:
            block[data.draw(st.integers(0, len(block) - 1))] ^= data.draw(st.integers(1, 255))
    block = bytes(block[: data.draw(st.integers(0, len(block)))])
    mutated = EncodedRoutes(Encoding.ZSTD, block, checksum(block), rows)
    _decode(mutated, geometry)
    other_rows = data.draw(st.integers(0, 80))
    _decode(EncodedRoutes(encoded.encoding, encoded.data, encoded.checksum, other_rows), geometry)
