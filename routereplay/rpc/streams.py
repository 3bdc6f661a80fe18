"""Whole requests and records from route chunks: the messages of a write or an append, and
the records a read stream carries, every block's checksum verified."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from routereplay.domain.codec import (
    EncodedRoutes,
    LayerParts,
    decode_layer_parts,
    decode_routes,
)
from routereplay.domain.record import Geometry, Missing, Record, TurnAppend
from routereplay.errors import InvalidArgument
from routereplay.rpc.chunks import (
    DEFAULT_CHUNK_BYTES,
    ChunkCollector,
    Headed,
    HeaderView,
    chunk_messages,
    chunk_of,
    first_chunk_of,
    first_room,
    message_part,
)
from routereplay.rpc.wire import (
    block_to_pb,
    encoded_from_pb,
    geometry_from_pb,
    geometry_to_pb,
    parts_from_pb,
    tokens_from_pb,
    turn_from_pb,
    turn_to_pb,
)
from routereplay.v1 import route_cache_pb2


def write_header(
    record: Record, encoded: EncodedRoutes | LayerParts, more_turns: bool = False
) -> Headed:
    """A write's header message, to send its block's first chunk with."""
    header = route_cache_pb2.RecordHeader(
        sample_id=record.sample_id,
        group_id=record.group_id,
        geometry=geometry_to_pb(record.geometry),
        token_ids=np.asarray(record.token_ids, "<i4").tobytes(),
        turns=[turn_to_pb(t) for t in record.turns],
        block=block_to_pb(encoded, 0, record.geometry),
        more_turns=more_turns,
    )
    return Headed.of(route_cache_pb2.WriteRecordRequest(header=header))


def append_header(
    append: TurnAppend, encoded: EncodedRoutes | LayerParts, final: bool = False
) -> Headed:
    """As ``write_header``, for an append."""
    header = route_cache_pb2.AppendHeader(
        sample_id=append.sample_id,
        geometry=geometry_to_pb(append.geometry),
        row_offset=append.row_offset,
        token_ids=np.asarray(append.token_ids, "<i4").tobytes(),
        turns=[turn_to_pb(t) for t in append.turns],
        block=block_to_pb(encoded, append.row_offset, append.geometry),
        final=final,
    )
    return Headed.of(route_cache_pb2.AppendTurnRequest(header=header))


@dataclass(frozen=True)
class BlockMessages:
    """The serialized messages of a write or append (send them as they are: no request
    serializer): the header with the block's first chunk, then the other chunks
    (``chunk_messages``), made anew by each call (a retry sends them whole again)."""

    header: Headed
    encoded: EncodedRoutes | LayerParts
    chunk_bytes: int = DEFAULT_CHUNK_BYTES

    def __call__(self) -> Iterator[bytes]:
        return chunk_messages(_route_pieces(self.encoded), 0, self.chunk_bytes, self.header)

    @property
    def single(self) -> bool:
        """Whether the header and every route byte fit in one message: then the call can be
        made unary (the same method on the wire), which spares gRPC Python's thread that feeds
        a request stream and its waits (a 6 KB write: 0.28 ms of client CPU against 0.83)."""
        size = sum(len(p) for p in _route_pieces(self.encoded))
        return size <= first_room(self.chunk_bytes, self.header)


def _route_pieces(encoded: EncodedRoutes | LayerParts) -> Sequence[bytes | memoryview]:
    """A written block's bytes: a whole block's, or its layer parts back to back."""
    return encoded.parts if isinstance(encoded, LayerParts) else [encoded.data]


class RecordAssembler:
    """Turns a read stream's messages back into records, verifying every block's checksum.
    Push-style, so the sync and the asyncio client share it."""

    def __init__(self):
        self._info = None
        self._geometry: Geometry | None = None
        self._blocks: list[np.ndarray] = []
        self._collector: ChunkCollector | None = None

    def feed(self, response: route_cache_pb2.ReadResponse) -> Record | Missing | None:
        """Returns a record (or a missing id) when ``response`` completes one."""
        part = message_part(response)
        if part == "missing_sample_id":
            return Missing(response.missing_sample_id)
        if part == "record":
            view = isinstance(response, HeaderView)
            self._info, self._blocks = response.header if view else response.record, []
            self._geometry = geometry_from_pb(self._info.geometry)
            self._collector = _next_collector(self._info, 0)
            first = first_chunk_of(response)
            return self._chunk(first) if first is not None else self._done()
        if part == "chunk":
            return self._chunk(chunk_of(response))
        raise InvalidArgument(f"unexpected read response part {part!r}")

    def _chunk(self, chunk) -> Record | None:
        if self._collector is None:
            raise InvalidArgument("route chunk before its record header")
        data = self._collector.add(chunk)
        if data is None:
            return None
        index = self._collector.block_index
        self._blocks.append(_decode_block(self._info, self._geometry, index, data))
        self._collector = _next_collector(self._info, index + 1)
        return self._done()

    def _done(self) -> Record | None:
        if self._collector is None:
            return _record_from_info(self._info, self._geometry, self._blocks)
        return None


def _selected_layers(info: route_cache_pb2.RecordInfo) -> tuple[int, ...] | None:
    return tuple(info.layers.indices) if info.HasField("layers") else None


def _decode_block(
    info: route_cache_pb2.RecordInfo, geometry: Geometry, index: int, data: bytes | memoryview
) -> np.ndarray:
    """Block ``index`` of a read record, checksums verified: ``[rows, layers, k]``."""
    block = info.blocks[index]
    if block.layer_parts:
        layers = _selected_layers(info) or tuple(range(geometry.num_moe_layers))
        return decode_layer_parts(parts_from_pb(block, data, layers), geometry, data)
    if info.HasField("layers"):
        raise InvalidArgument("a layer-selected read must send layer parts")
    return decode_routes(encoded_from_pb(block, data), geometry)


def _next_collector(info: route_cache_pb2.RecordInfo, index: int) -> ChunkCollector | None:
    if index >= len(info.blocks):
        return None
    return ChunkCollector(index, info.blocks[index].encoded_size)


def _record_from_info(
    info: route_cache_pb2.RecordInfo, geometry: Geometry, blocks: list[np.ndarray]
) -> Record:
    layers = _selected_layers(info)
    if len(blocks) == 1:
        routes = blocks[0]
    elif blocks:
        routes = np.concatenate(blocks)
    else:
        width = geometry.num_moe_layers if layers is None else len(layers)
        routes = np.zeros((0, width, geometry.topk), geometry.dtype)
    return Record(
        sample_id=info.sample_id,
        geometry=geometry,
        token_ids=tokens_from_pb(info.token_ids),
        routes=routes,
        turns=[turn_from_pb(t, i) for i, t in enumerate(info.turns)],
        group_id=info.group_id,
        layers=layers,
    )
