"""Chunk messages (and headers with their first chunk) encoded and parsed by hand
(``routereplay.rpc.chunks``, ``routereplay.rpc.streams``), against protobuf's own serializer and
parser as the oracle."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routereplay.domain.codec import EncodedRoutes, Encoding
from routereplay.rpc.chunks import (
    ChunkFirst,
    ChunkView,
    Headed,
    HeaderView,
    chunk_messages,
    encode_chunk_message,
    first_chunk_of,
    message_part,
    parse_chunk_message,
)
from routereplay.rpc.streams import BlockMessages
from routereplay.v1 import record_pb2, route_cache_pb2

PARENTS = [
    route_cache_pb2.ReadResponse,
    route_cache_pb2.WriteRecordRequest,
    route_cache_pb2.AppendTurnRequest,
]
chunks = st.builds(
    record_pb2.RouteChunk,
    block=st.integers(0, 2**32 - 1),
    offset=st.integers(0, 2**64 - 1),
    data=st.binary(max_size=300),
    last=st.booleans(),
)


@settings(max_examples=300, deadline=None)
@given(chunks, st.integers(1, 5), st.sampled_from(PARENTS))
def test_encoding_is_protobufs_byte_for_byte(chunk, pieces, parent):
    cut = len(chunk.data) // pieces
    parts = [chunk.data[i * cut : (i + 1) * cut] for i in range(pieces - 1)]
    parts.append(memoryview(chunk.data)[(pieces - 1) * cut :])
    encoded = encode_chunk_message(chunk.block, chunk.offset, parts, chunk.last)
    assert encoded == parent(chunk=chunk).SerializeToString()


@settings(max_examples=300, deadline=None)
@given(chunks, st.sampled_from(PARENTS))
def test_parsing_agrees_with_protobuf(chunk, parent):
    view = parse_chunk_message(parent(chunk=chunk).SerializeToString())
    assert (view.block, view.offset, bytes(view.data), view.last) == (
        chunk.block,
        chunk.offset,
        chunk.data,
        chunk.last,
    )


def _fields(message):
    """A parsed message's chunk, or None when it holds no chunk."""
    if isinstance(message, ChunkView):
        return message.block, message.offset, bytes(message.data), message.last
    if message_part(message) != "chunk":
        return None
    c = message.chunk
    return c.block, c.offset, c.data, c.last


@settings(max_examples=2000, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=40),
        # Chunk-shaped bytes with random fields inside: other wire types, unknown fields, repeats.
        st.binary(max_size=30).map(lambda inner: b"\x12" + bytes([len(inner)]) + inner),
        # Varints of 10 bytes, and tags of 6: protobuf drops the high bits, or refuses the tag.
        st.sampled_from(
            [b"\x12\x0b\x10" + b"\xff" * 9 + b"\x7f", b"\x12\x07\xf8" + b"\xff" * 4 + b"\x8f\x00"]
        ),
    )
)
def test_any_bytes_parse_as_protobuf_parses_them(raw):
    """Whatever the fast path accepts, protobuf reads the same chunk from; what it leaves,
    protobuf parses or refuses on its own."""
    try:
        expected = _fields(route_cache_pb2.ReadResponse.FromString(raw))
    except Exception:  # noqa: BLE001 - protobuf refuses these bytes
        expected = "refused"
    view = parse_chunk_message(raw)
    if view is not None:
        assert _fields(view) == expected
    parse = ChunkFirst(route_cache_pb2.ReadResponse)
    if expected == "refused":
        with pytest.raises(Exception):  # noqa: B017 - protobuf's own DecodeError
            parse(raw)
    else:
        assert _fields(parse(raw)) == expected


def test_other_parts_go_through_protobuf():
    parse = ChunkFirst(route_cache_pb2.ReadResponse)
    missing = parse(route_cache_pb2.ReadResponse(missing_sample_id="s1").SerializeToString())
    assert message_part(missing) == "missing_sample_id"
    assert missing.missing_sample_id == "s1"
    assert parse.DESCRIPTOR.full_name == "routereplay.v1.ReadResponse"


HEADED = [
    (route_cache_pb2.WriteRecordRequest, "header"),
    (route_cache_pb2.AppendTurnRequest, "header"),
    (route_cache_pb2.ReadResponse, "record"),
]
headers = st.builds(
    route_cache_pb2.RecordHeader,
    sample_id=st.text("abc-", max_size=20),
    token_ids=st.binary(max_size=200),
    more_turns=st.booleans(),
)


def _header(parent, part: str, fields: route_cache_pb2.RecordHeader):
    """A header of ``parent``'s kind (RecordHeader, AppendHeader or RecordInfo) with the
    fields they share."""
    header_type = type(getattr(parent(), part))
    return header_type(sample_id=fields.sample_id, token_ids=fields.token_ids)


@settings(max_examples=300, deadline=None)
@given(headers, chunks, st.sampled_from(HEADED))
def test_a_header_with_its_first_chunk_is_protobufs_byte_for_byte(fields, chunk, kind):
    parent, part = kind
    header = _header(parent, part, fields)
    headed = Headed.of(parent(**{part: header}))
    raw = encode_chunk_message(chunk.block, chunk.offset, [chunk.data], chunk.last, headed)
    assert raw == parent(**{part: header}, first_chunk=chunk).SerializeToString()
    parsed = ChunkFirst(parent)(raw)  # by hand: the chunk's data a view of the message
    assert isinstance(parsed, HeaderView) and message_part(parsed) == part
    assert parsed.header == header
    assert _fields(parsed.first_chunk) == (chunk.block, chunk.offset, chunk.data, chunk.last)


@pytest.mark.parametrize("parent, part", HEADED)
def test_a_header_and_first_chunk_in_another_order_go_through_protobuf(parent, part):
    chunk = record_pb2.RouteChunk(offset=0, data=b"abc", last=True)
    header = _header(parent, part, route_cache_pb2.RecordHeader(sample_id="s1"))
    raw = (
        parent(first_chunk=chunk).SerializeToString() + parent(**{part: header}).SerializeToString()
    )
    parsed = ChunkFirst(parent)(raw)
    assert not isinstance(parsed, HeaderView) and message_part(parsed) == part
    assert getattr(parsed, part) == header and first_chunk_of(parsed) == chunk
    alone = parent(**{part: header}).SerializeToString()
    assert first_chunk_of(ChunkFirst(parent)(alone)) is None


@pytest.mark.parametrize("header_bytes", [0, 10, 99, 100, 250])
def test_the_first_chunk_takes_what_fits_beside_the_header(header_bytes):
    """No message outgrows ``chunk_bytes`` or the header alone: the first chunk takes what is
    left of ``chunk_bytes`` beside the header, and the chunks still cover the block."""
    header = route_cache_pb2.RecordHeader(token_ids=b"t" * header_bytes)
    headed = Headed.of(route_cache_pb2.WriteRecordRequest(header=header))
    data = bytes(range(256)) * 2
    messages = list(chunk_messages([data[:200], data[200:]], 0, 100, headed))
    first = ChunkFirst(route_cache_pb2.WriteRecordRequest)(messages[0])
    assert first_chunk_of(first) is not None and message_part(first) == "header"
    sizes = [len(first_chunk_of(first).data)]
    sizes += [len(parse_chunk_message(m).data) for m in messages[1:]]
    assert sizes[0] == max(0, 100 - len(headed.message)) and all(s == 100 for s in sizes[1:-1])
    joined = bytes(first_chunk_of(first).data)
    joined += b"".join(bytes(parse_chunk_message(m).data) for m in messages[1:])
    assert joined == data


@pytest.mark.parametrize("spare", [-2, -1, 0, 1, 2])
def test_a_block_is_one_message_exactly_when_its_stream_is_one(spare):
    """``BlockMessages.single`` (a unary call instead of a stream) says what the stream
    itself makes: one message when the header and every route byte fit in ``chunk_bytes``."""
    header = Headed.of(route_cache_pb2.WriteRecordRequest(header=route_cache_pb2.RecordHeader()))
    chunk_bytes = 200
    size = chunk_bytes - len(header.message) + spare
    routes = EncodedRoutes(Encoding.RAW, bytes(size), 0, size)
    messages = BlockMessages(header, routes, chunk_bytes)
    assert messages.single == (len(list(messages())) == 1) == (spare <= 0)
