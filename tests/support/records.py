"""Records as a test sends them: a whole block encoded at once, and a write's or an append's
serialized messages.

Production clients write layer parts (``encode_layer_parts``); a whole block (RAW row-major
or ZSTD, the other encoding the contract accepts) is written only here, so that the route
cache's handling of it stays tested.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import zstandard

from routereplay.domain.codec import EncodedRoutes, Encoding, LayerParts, checksum
from routereplay.domain.record import Record, TurnAppend
from routereplay.rpc.chunks import DEFAULT_CHUNK_BYTES
from routereplay.rpc.streams import BlockMessages, append_header, write_header


def encode_routes(
    routes: np.ndarray, encoding: Encoding = Encoding.RAW, level: int = 1
) -> EncodedRoutes:
    """Encode ``routes`` ``[rows, L, k]`` as one block; with ZSTD (one frame per layer after
    a table of the frame sizes, uint32 LE), falls back to RAW when not smaller."""
    raw = np.ascontiguousarray(routes).tobytes()
    data, used = raw, Encoding.RAW
    if encoding is Encoding.ZSTD and raw:
        compressor = zstandard.ZstdCompressor(level=level)
        frames = [
            compressor.compress(np.ascontiguousarray(routes[:, j])) for j in range(routes.shape[1])
        ]
        sizes = np.array([len(f) for f in frames], "<u4")
        compressed = sizes.tobytes() + b"".join(frames)
        if len(compressed) < len(raw):
            data, used = compressed, Encoding.ZSTD
    return EncodedRoutes(used, data, checksum(data), int(routes.shape[0]))


def write_requests(
    record: Record,
    encoded: EncodedRoutes | LayerParts,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    more_turns: bool = False,
) -> Iterator[bytes]:
    """The serialized messages of a write (``BlockMessages``)."""
    return BlockMessages(write_header(record, encoded, more_turns), encoded, chunk_bytes)()


def append_requests(
    append: TurnAppend,
    encoded: EncodedRoutes | LayerParts,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    final: bool = False,
) -> Iterator[bytes]:
    """As ``write_requests``, for an append."""
    return BlockMessages(append_header(append, encoded, final), encoded, chunk_bytes)()
