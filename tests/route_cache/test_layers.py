"""Layer-selected reads, over real gRPC on a real single node and a real 3-master cluster: the
same columns as a whole read, per-layer checksums, bad selections, and the old storage format."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import grpc
import numpy as np
import pytest
import xxhash

from route_cache.record_format import record_key, routes_key
from routereplay.dev.synthetic import synthetic_record
from routereplay.domain.codec import Encoding, encode_layer_parts, split_layers
from routereplay.domain.record import Record, Turn, TurnAppend
from routereplay.errors import DataLoss, FailedPrecondition, InvalidArgument
from routereplay.rpc.client import AsyncRouteCacheClient
from routereplay.rpc.streams import RecordAssembler
from routereplay.v1 import record_pb2, route_cache_pb2, route_cache_pb2_grpc
from tests.route_cache.conftest import SMALL, WIDE, as_messages
from tests.support.records import encode_routes, write_requests

SELECTIONS = [range(0, 1), range(1, 3), [0, 2], [4], range(5)]


def read_records(responses):
    """The records (and missing ids) of a read stream, as they complete."""
    assembler = RecordAssembler()
    for response in responses:
        item = assembler.feed(response)
        if item is not None:
            yield item


def three_turns(client, sample_id, geometry, rng) -> Record:
    """A record written as a first turn and two appends; returns the whole of it."""
    whole = synthetic_record(sample_id, geometry, 2400, rng, skew=1.0, prompt_tokens=100)
    cuts = [0, 1000, 1700, 2400]  # token boundaries of the turns
    turns = [
        Turn(a, b, a + 50 if a else 100, i)
        for i, (a, b) in enumerate(zip(cuts, cuts[1:], strict=False))
    ]
    client.write(Record(sample_id, geometry, whole.token_ids[:1000], whole.routes[:999], turns[:1]))
    for turn in turns[1:]:
        a, b = turn.token_start, turn.token_end
        client.append(
            TurnAppend(
                sample_id,
                geometry,
                a - 1,
                whole.token_ids[a:b],
                whole.routes[a - 1 : b - 1],
                [turn],
            )
        )
    return whole


@pytest.mark.parametrize("geometry", [SMALL, WIDE], ids=["uint8", "uint16"])
@pytest.mark.parametrize("encoding", list(Encoding))
def test_selected_layers_equal_the_whole_reads_columns(
    cache, redis_client, rng, sid, geometry, encoding
):
    client, _ = cache
    client.encoding = encoding
    sample_id = sid()
    written = three_turns(client, sample_id, geometry, rng)
    stored = json.loads(redis_client.hget(record_key(sample_id), "b@0"))
    assert stored["encoding"] == encoding.value  # skewed routes: zstd does shrink them
    whole = client.read(sample_id)
    assert whole.layers is None
    np.testing.assert_array_equal(whole.routes, written.routes)
    for selection in SELECTIONS:
        selection = [i for i in selection if i < geometry.num_moe_layers] or [0]
        got = client.read(sample_id, layers=selection)
        assert got.layers == tuple(selection)
        assert got.moe_layers == tuple(geometry.moe_layers[i] for i in selection)
        assert got.routes.shape == (2399, len(selection), geometry.topk)
        np.testing.assert_array_equal(got.routes, whole.routes[:, selection])
        np.testing.assert_array_equal(got.token_ids, whole.token_ids)
        assert [t.policy_version for t in got.turns] == [0, 1, 2]


def test_batch_and_async_reads_select_layers(cache, rng, sid):
    client, server = cache
    records = [synthetic_record(sid(), SMALL, int(n), rng) for n in (1, 50, 700)]
    for record in records:
        client.write(record)
    ids = [r.sample_id for r in records]
    got = list(client.read_batch(ids, layers=range(2, 4)))
    for a, b in zip(got, records, strict=True):
        assert a.layers == (2, 3)
        np.testing.assert_array_equal(a.routes, b.routes[:, 2:4])

    async def run():
        async with AsyncRouteCacheClient(f"127.0.0.1:{server.port}") as aclient:
            one = await aclient.read(ids[2], layers=[1])
            return one, [r async for r in aclient.read_batch(ids, layers=[0, 4])]

    one, batch = asyncio.run(run())
    np.testing.assert_array_equal(one.routes, records[2].routes[:, [1]])
    for a, b in zip(batch, records, strict=True):
        np.testing.assert_array_equal(a.routes, b.routes[:, [0, 4]])


def test_a_corrupt_layer_fails_only_its_own_reads(cache, redis_client, rng, sid):
    client, _ = cache
    record = synthetic_record(sid(), SMALL, 500, rng)
    client.write(record)
    key = routes_key(record.sample_id)  # layer-major: layer 2 starts after 2 layers' rows
    at = 2 * 499 * SMALL.topk + 7
    redis_client.setrange(key, at, bytes([redis_client.getrange(key, at, at)[0] ^ 0x01]))
    with pytest.raises(DataLoss, match="MoE layer index 2"):
        client.read(record.sample_id)
    with pytest.raises(DataLoss, match="MoE layer index 2"):
        client.read(record.sample_id, layers=[1, 2])
    got = client.read(record.sample_id, layers=[0, 1, 3, 4])
    np.testing.assert_array_equal(got.routes, record.routes[:, [0, 1, 3, 4]])


@pytest.fixture
def stub(cache):
    _, server = cache
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield route_cache_pb2_grpc.RouteCacheStub(channel)
    channel.close()


@pytest.mark.parametrize(
    "indices, match",
    [
        ([], "layers.indices is empty"),
        ([2, 1], "layers.indices is not in ascending order at [1]"),
        ([1, 1], "layers.indices repeats at [1]"),
        ([0, 5], "layers.indices[1] is 5; the geometry has 5 MoE layers"),
    ],
)
def test_bad_selections_are_invalid_argument(cache, stub, rng, sid, indices, match):
    client, _ = cache
    record = synthetic_record(sid(), SMALL, 20, rng)
    client.write(record)
    selection = record_pb2.LayerSelection(indices=indices)
    calls = [
        lambda: list(
            stub.ReadRecord(
                route_cache_pb2.ReadRecordRequest(sample_id=record.sample_id, layers=selection),
                timeout=10,
            )
        ),
        lambda: list(
            stub.ReadBatch(
                route_cache_pb2.ReadBatchRequest(sample_ids=[record.sample_id], layers=selection),
                timeout=10,
            )
        ),
    ]
    for call in calls:
        with pytest.raises(grpc.RpcError) as info:
            call()
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert match in info.value.details(), info.value.details()
    if indices and max(indices) < SMALL.num_moe_layers:  # the client refuses these itself
        with pytest.raises(InvalidArgument, match=r"layers (is not|repeats)"):
            client.read(record.sample_id, layers=indices)


def test_a_reader_without_layer_parts_gets_whole_blocks(cache, stub, rng, sid):
    """A client of before per-layer storage asks for neither layers nor parts: each block
    comes reassembled in the single-block form, with its whole-block checksum."""
    client, _ = cache
    for encoding in Encoding:
        client.encoding = encoding
        sample_id = sid()
        written = three_turns(client, sample_id, SMALL, rng)
        responses = list(stub.ReadRecord(route_cache_pb2.ReadRecordRequest(sample_id=sample_id)))
        blocks = responses[0].record.blocks
        assert len(blocks) == 3 and not any(b.layer_parts for b in blocks)
        (got,) = read_records(iter(responses))
        np.testing.assert_array_equal(got.routes, written.routes)


def test_records_in_the_old_format_read_whole_and_refuse_selection(cache, redis_client, rng, sid):
    client, _ = cache
    record = synthetic_record(sid(), SMALL, 300, rng)
    # The hash the route cache wrote before per-layer storage (format 1).
    encoded = encode_routes(record.routes)
    turn = record.turns[0]
    tokens = record.token_ids.tobytes() + turn.logprobs.tobytes()
    desc = {
        "row_start": 0,
        "num_rows": 299,
        "token_start": 0,
        "num_tokens": 300,
        "encoding": "raw",
        "checksum": encoded.checksum,
        "tokens_checksum": xxhash.xxh3_64_intdigest(tokens),
        "turns": [[0, 300, turn.generated_start, 0, turn.logprobs.size]],
    }
    geometry = {
        "format": 1,
        "moe_layers": list(SMALL.moe_layers),
        "topk": SMALL.topk,
        "num_experts": SMALL.num_experts,
        "model_id": SMALL.model_id,
    }
    redis_client.hset(
        record_key(record.sample_id),
        mapping={
            "geometry": json.dumps(geometry, sort_keys=True, separators=(",", ":")),
            "group": "",
            "rows": 299,
            "tokens": 300,
            "b@0": json.dumps(desc),
            "t@0": tokens,
            "r@0": encoded.data,
        },
    )
    np.testing.assert_array_equal(client.read(record.sample_id).routes, record.routes)
    assert client.stat(record.sample_id).route_bytes == len(encoded.data)  # one whole field
    with pytest.raises(FailedPrecondition, match="delete it and write it again"):
        client.read(record.sample_id, layers=[1])
    more = TurnAppend(
        record.sample_id, SMALL, 299, record.token_ids[:5], record.routes[:5], [Turn(300, 305, 300)]
    )
    with pytest.raises(FailedPrecondition, match="storage format 1"):
        client.append(more)


def test_records_in_format_2_read_whole_and_by_selection_and_refuse_appends(
    cache, redis_client, rng, sid
):
    """The hash with a field per MoE layer per block that the route cache wrote before the
    layer-major routes value (format 2): still read, whole and by layer selection, with the
    same checksums; an append or a write under its id is refused, saying what to do."""
    client, _ = cache
    record = synthetic_record(sid(), SMALL, 300, rng)
    parts = split_layers(encode_routes(record.routes), SMALL)
    turn = record.turns[0]
    tokens = record.token_ids.tobytes() + turn.logprobs.tobytes()
    desc = {
        "row_start": 0,
        "num_rows": 299,
        "token_start": 0,
        "num_tokens": 300,
        "encoding": "raw",
        "parts": [[len(p), c] for p, c in zip(parts.parts, parts.checksums, strict=True)],
        "tokens_checksum": xxhash.xxh3_64_intdigest(tokens),
        "turns": [[0, 300, turn.generated_start, 0, turn.logprobs.size]],
    }
    geometry = {
        "format": 2,
        "moe_layers": list(SMALL.moe_layers),
        "topk": SMALL.topk,
        "num_experts": SMALL.num_experts,
        "model_id": SMALL.model_id,
    }
    fields = {
        "geometry": json.dumps(geometry, sort_keys=True, separators=(",", ":")),
        "group": "",
        "rows": 299,
        "tokens": 300,
        "b@0": json.dumps(desc),
        "t@0": tokens,
    }
    fields.update({f"r@0:{j}": bytes(p) for j, p in enumerate(parts.parts)})
    redis_client.hset(record_key(record.sample_id), mapping=fields)
    np.testing.assert_array_equal(client.read(record.sample_id).routes, record.routes)
    got = client.read(record.sample_id, layers=[1, 3])
    np.testing.assert_array_equal(got.routes, record.routes[:, [1, 3]])
    (batch,) = client.read_batch([record.sample_id], layers=range(2, 4))
    np.testing.assert_array_equal(batch.routes, record.routes[:, 2:4])
    assert client.stat(record.sample_id).route_bytes == 299 * SMALL.row_bytes
    more = TurnAppend(
        record.sample_id, SMALL, 299, record.token_ids[:5], record.routes[:5], [Turn(300, 305, 300)]
    )
    with pytest.raises(FailedPrecondition, match="storage format 2.*delete it and write it again"):
        client.append(more)
    with pytest.raises(FailedPrecondition, match="storage format 2"):
        client.write(record)


@pytest.mark.parametrize("geometry", [SMALL, WIDE], ids=["uint8", "uint16"])
def test_layer_major_writes_are_checked_per_part_and_name_the_row_and_layer(
    cache, stub, rng, sid, geometry
):
    """A write sent layer-major (what the client sends): each part's checksum verified, and
    every id checked where it lies, refused naming the record's row and the global layer."""
    client, _ = cache
    record = synthetic_record(sid(), geometry, 300, rng)

    def refused(routes, corrupt_layer=None):
        parts = encode_layer_parts(routes)
        if corrupt_layer is not None:
            checksums = list(parts.checksums)
            checksums[corrupt_layer] ^= 1
            parts = replace(parts, checksums=tuple(checksums))
        with pytest.raises(grpc.RpcError) as info:
            stub.WriteRecord(iter(as_messages(write_requests(record, parts))), timeout=10)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        return info.value.details()

    assert "MoE layer index 2" in refused(record.routes, corrupt_layer=2)
    bad = record.routes.copy()
    bad[123, 1, 0] = geometry.num_experts if geometry is WIDE else 255
    layer = geometry.moe_layers[1]
    assert f"routes[123] layer {layer}: expert id" in refused(bad)
    bad = record.routes.copy()
    bad[250, 2, -1] = bad[250, 2, 0]
    assert f"routes[250] layer {geometry.moe_layers[2]}: expert ids repeat" in refused(bad)
    with pytest.raises(Exception, match="no record"):
        client.stat(record.sample_id)  # nothing stored by any of them
    client.write(record)  # and the good record goes in
    np.testing.assert_array_equal(client.read(record.sample_id).routes, record.routes)
