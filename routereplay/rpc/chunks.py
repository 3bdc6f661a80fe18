"""Route chunks on the wire, framed by hand.

Chunk messages (a ``RouteChunk`` as field 2 of ``WriteRecordRequest``, ``AppendTurnRequest``
and ``ReadResponse``) are most of the bytes a call moves. They are encoded and parsed here by
hand: encoding copies the route bytes once, where protobuf copies them into the chunk, into
its parent and into the serialized string; parsing hands out a view of the received message
(``ChunkView``) instead of two copies. Any other message, or a chunk message in another
valid encoding, goes through protobuf. Route bytes move as chunks of one block's encoded
bytes, never per token.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from google.protobuf.message_factory import GetMessageClass

from routereplay.errors import InvalidArgument
from routereplay.v1 import record_pb2

DEFAULT_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class ChunkView:
    """A parsed ``RouteChunk`` whose ``data`` is a view of the message it came in."""

    block: int
    offset: int
    data: memoryview | bytes
    last: bool


# Tags (field number << 3 | wire type) of the chunk message layout.
_CHUNK_TAG = b"\x12"  # field 2, length-delimited: the RouteChunk in its parent
_BLOCK, _OFFSET, _DATA, _LAST = 0x08, 0x10, 0x1A, 0x20  # RouteChunk fields 1-4


def _tag(descriptor, field: str) -> bytes:
    """The one-byte tag of a length-delimited field (field numbers below 16)."""
    return bytes([descriptor.fields_by_name[field].number << 3 | 2])


@dataclass(frozen=True)
class Headed:
    """A header message to send a block's first chunk with: the parent message holding only
    its header (``header`` of a write or append, ``record`` of a read), serialized, and the
    tag of its ``first_chunk`` field."""

    message: bytes
    chunk_tag: bytes

    @classmethod
    def of(cls, message) -> Headed:
        return cls(message.SerializeToString(), _tag(message.DESCRIPTOR, "first_chunk"))


def _varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(raw, pos: int, max_bytes: int = 10) -> tuple[int, int]:
    """The varint at ``pos`` and the position after it; IndexError past the end or past
    ``max_bytes`` (protobuf's limits: 10 bytes, 5 for a tag)."""
    value = shift = 0
    for i in range(pos, pos + max_bytes):
        byte = raw[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value & 0xFFFFFFFFFFFFFFFF, i + 1  # a 10th byte's high bits are dropped
        shift += 7
    raise IndexError(f"varint longer than {max_bytes} bytes")


def encode_chunk_message(
    block: int,
    offset: int,
    pieces: Sequence[bytes | memoryview],
    last: bool,
    header: Headed | None = None,
) -> bytes:
    """The serialized parent message holding ``RouteChunk(block, offset, data=the pieces
    joined, last)``, byte for byte what protobuf writes; the pieces are copied once.
    ``header``: a header to send the chunk with, as the message's ``first_chunk``."""
    size = sum(len(p) for p in pieces)
    head = b""
    if block:
        head += bytes([_BLOCK]) + _varint(block)
    if offset:
        head += bytes([_OFFSET]) + _varint(offset)
    if size:
        head += bytes([_DATA]) + _varint(size)
    tail = bytes([_LAST, 1]) if last else b""
    inner = len(head) + size + len(tail)
    tag, prefix = (_CHUNK_TAG, b"") if header is None else (header.chunk_tag, header.message)
    return b"".join([prefix, tag, _varint(inner), head, *pieces, tail])


def parse_chunk_message(raw: bytes | memoryview, tag: bytes = _CHUNK_TAG) -> ChunkView | None:
    """The chunk of a serialized chunk message, its data a view of ``raw``; None when
    ``raw`` is not exactly one chunk field (``tag``) of varint and length-delimited fields
    (anything else, valid or not, is left to protobuf)."""
    if raw[:1] != tag:
        return None
    try:
        size, pos = _read_varint(raw, 1)
        if pos + size != len(raw):
            return None
        block = offset = 0
        data, last = b"", False
        while pos < len(raw):
            tag, pos = _read_varint(raw, pos, max_bytes=5)
            if not 0 < tag >> 3 < 1 << 29:  # no such field number: protobuf refuses it
                return None
            if tag & 7 == 0:
                value, pos = _read_varint(raw, pos)
                if tag == _BLOCK:
                    block = value & 0xFFFFFFFF  # uint32, as protobuf truncates it
                elif tag == _OFFSET:
                    offset = value
                elif tag == _LAST:
                    last = value != 0
            elif tag & 7 == 2:
                length, pos = _read_varint(raw, pos)
                if pos + length > len(raw):
                    return None
                if tag == _DATA:
                    data = memoryview(raw)[pos : pos + length]
                pos += length
            else:
                return None
    except IndexError:
        return None
    return ChunkView(block, offset, data, last)


@dataclass(frozen=True)
class HeaderView:
    """A parsed header message that came with its block's first chunk (``first_chunk``),
    the chunk's data a view of the message. ``part``: the header's field (``header`` or
    ``record``)."""

    part: str
    header: object  # RecordHeader, AppendHeader or RecordInfo
    first_chunk: ChunkView


class ChunkFirst:
    """The deserializer of a message type that carries route chunks: chunk messages, and
    headers with their first chunk (``HeaderView``), by hand, the chunks' data as views of
    the message; everything else by protobuf."""

    def __init__(self, message_type):
        self.message_type = message_type
        self.DESCRIPTOR = message_type.DESCRIPTOR
        fields = message_type.DESCRIPTOR.fields_by_name
        # (part, its tag, its type, the first chunk's tag) where a first chunk may come with it
        self._header = None
        if "first_chunk" in fields:
            part = "header" if "header" in fields else "record"
            self._header = (
                part,
                _tag(message_type.DESCRIPTOR, part),
                GetMessageClass(fields[part].message_type),
                _tag(message_type.DESCRIPTOR, "first_chunk"),
            )

    def __call__(self, raw: bytes):
        return (
            parse_chunk_message(raw)
            or self._header_with_chunk(raw)
            or self.message_type.FromString(raw)
        )

    def _header_with_chunk(self, raw: bytes) -> HeaderView | None:
        """The layout ``encode_chunk_message`` writes with a header: the header field, then
        the first chunk's field, nothing else; None otherwise (left to protobuf)."""
        if self._header is None or raw[:1] != self._header[1]:
            return None
        part, _, header_type, chunk_tag = self._header
        try:
            size, pos = _read_varint(raw, 1)
        except IndexError:
            return None
        end = pos + size
        chunk = parse_chunk_message(memoryview(raw)[end:], chunk_tag)
        if chunk is None:
            return None
        return HeaderView(part, header_type.FromString(memoryview(raw)[pos:end]), chunk)


def message_part(message) -> str | None:
    """Which of a route message's ``part`` oneof is set ("chunk" for a ``ChunkView``)."""
    if isinstance(message, ChunkView):
        return "chunk"
    return message.part if isinstance(message, HeaderView) else message.WhichOneof("part")


def first_chunk_of(message) -> ChunkView | record_pb2.RouteChunk | None:
    """The first chunk a header message carries, if any."""
    if isinstance(message, HeaderView):
        return message.first_chunk
    return message.first_chunk if message.HasField("first_chunk") else None


def chunk_of(message) -> ChunkView | record_pb2.RouteChunk:
    return message if isinstance(message, ChunkView) else message.chunk


def first_room(chunk_bytes: int, header: Headed | None) -> int:
    """Route bytes the first chunk message holds: what ``chunk_bytes`` leaves beside the
    header it goes with."""
    return chunk_bytes - (0 if header is None else len(header.message))


def chunk_messages(
    parts, block: int, chunk_bytes: int, header: Headed | None = None
) -> Iterator[bytes]:
    """``parts`` back to back as serialized chunk messages of ``chunk_bytes`` (the last one
    marked, even when empty), each chunk's bytes copied once from the parts it spans. With
    ``header``, the first chunk goes in the header's message, as many bytes as
    fit beside it in ``chunk_bytes`` (none past that: no message grows beyond the larger of
    the two)."""
    total = sum(len(p) for p in parts)
    views = iter(memoryview(p) for p in parts)
    current, offset = memoryview(b""), 0
    room = first_room(chunk_bytes, header)
    while True:
        pieces, size = [], 0
        while size < room:
            if not current:
                current = next(views, None)
                if current is None:
                    break
                continue
            piece = current[: room - size]
            pieces.append(piece)
            size += len(piece)
            current = current[len(piece) :]
        yield encode_chunk_message(block, offset, pieces, offset + size >= total, header)
        header, room = None, chunk_bytes
        offset += size
        if offset >= total:
            return


class ChunkCollector:
    """Reassembles one block's chunks, refusing any out of order, overlapping or missing."""

    def __init__(self, block_index: int, size: int):
        self.block_index = block_index
        self.size = size
        self._parts: list[bytes] = []
        self._received = 0
        self.done = False

    def add(self, chunk: record_pb2.RouteChunk) -> bytes | memoryview | None:
        """Add a chunk; returns the block's bytes on its last chunk: a block of one chunk as
        it came (a view of the received message, read-only, not copied), else joined."""
        last = self.check(chunk)
        self._parts.append(chunk.data)
        if not last:
            return None
        parts, self._parts = self._parts, []
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def check(self, chunk: record_pb2.RouteChunk) -> bool:
        """Refuse a chunk out of place; True when it is the block's last."""
        if self.done:
            raise InvalidArgument(f"chunk after the last chunk of block {self.block_index}")
        if chunk.block != self.block_index:
            raise InvalidArgument(f"chunk of block {chunk.block}; expected {self.block_index}")
        if chunk.offset != self._received:
            kind = "overlapping" if chunk.offset < self._received else "out of order or missing"
            raise InvalidArgument(
                f"chunk at offset {chunk.offset}, expected {self._received} ({kind})"
            )
        self._received += len(chunk.data)
        if self._received > self.size:
            raise InvalidArgument(f"chunks carry more than block.encoded_size={self.size} bytes")
        if not chunk.last:
            return False
        if self._received != self.size:
            raise InvalidArgument(
                f"last chunk ends at {self._received} bytes; block.encoded_size is {self.size}"
            )
        self.done = True
        return True
