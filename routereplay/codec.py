"""The route block codec: how a block of routes is turned into bytes and back.

A block is ``[rows, L, k]`` routes (uint8 when num_experts <= 256, else uint16 little-endian),
encoded either RAW (row-major) or ZSTD (one zstd frame per layer, after a table of the L frame
sizes as uint32 LE), with an xxh3-64 checksum of the encoded bytes that every write and read
verifies. Compression is used only when it shrinks the block, so stored bytes never exceed
raw uint8/uint16.

Why per layer: each layer has its own expert popularity; row-major bytes interleave the
layers and zstd's entropy coder sees their mixture, which is nearly uniform. Measured on
32K-token Qwen3-30B-A3B routes with Zipf(1.0) popularity: 0.873 of raw row-major, 0.752
layer by layer (uniform routes: 0.875 either way, 7 of 8 bits). lz4 saves nothing on routes.
zstd costs about 0.35 GB/s to encode and 0.5 GB/s to decode, slower than Redis itself, so RAW
is the default and ZSTD is for memory-bound Redis (see docs/benchmarks.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import xxhash
import zstandard

from routereplay.errors import DataLoss, InvalidArgument
from routereplay.record import Geometry


class Encoding(StrEnum):
    RAW = "raw"
    ZSTD = "zstd"


@dataclass(frozen=True)
class EncodedRoutes:
    """A block's routes as stored and sent."""

    encoding: Encoding
    data: bytes
    checksum: int
    num_rows: int


def checksum(data: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


def encode_routes(
    routes: np.ndarray, encoding: Encoding = Encoding.RAW, level: int = 1
) -> EncodedRoutes:
    """Encode ``routes`` ``[rows, L, k]``; with ZSTD, falls back to RAW when not smaller."""
    raw = np.ascontiguousarray(routes).tobytes()
    data, used = raw, Encoding.RAW
    if encoding is Encoding.ZSTD and raw:
        compressor = zstandard.ZstdCompressor(level=level)
        frames = [compressor.compress(np.ascontiguousarray(routes[:, j])) for j in
                  range(routes.shape[1])]  # fmt: skip
        sizes = np.array([len(f) for f in frames], "<u4")
        compressed = sizes.tobytes() + b"".join(frames)
        if len(compressed) < len(raw):
            data, used = compressed, Encoding.ZSTD
    return EncodedRoutes(used, data, checksum(data), int(routes.shape[0]))


def decode_routes(encoded: EncodedRoutes, geometry: Geometry) -> np.ndarray:
    """Verify the checksum and decode into ``[num_rows, L, k]`` of ``geometry.dtype``.

    RAW decodes without a copy: the result is a read-only view of ``encoded.data``.

    Raises:
        DataLoss: the checksum does not match the bytes.
        InvalidArgument: the bytes do not hold ``num_rows`` rows of this geometry.
    """
    if checksum(encoded.data) != encoded.checksum:
        raise DataLoss(
            f"route block checksum mismatch ({len(encoded.data)} bytes, {encoded.num_rows} rows)"
        )
    expected = encoded.num_rows * geometry.row_bytes
    shape = (encoded.num_rows, geometry.num_moe_layers, geometry.topk)
    if encoded.encoding is Encoding.ZSTD:
        return _decode_zstd(encoded.data, shape, geometry.dtype)
    raw = encoded.data
    if len(raw) != expected:
        raise InvalidArgument(
            f"route block holds {len(raw)} bytes; {encoded.num_rows} rows of "
            f"{geometry.num_moe_layers} layers x top-{geometry.topk} as {geometry.dtype} "
            f"need {expected}"
        )
    return np.frombuffer(raw, dtype=geometry.dtype).reshape(shape)


def _decode_zstd(data: bytes, shape: tuple[int, int, int], dtype: np.dtype) -> np.ndarray:
    rows, layers, k = shape
    table = 4 * layers
    if len(data) < table:
        raise InvalidArgument(f"zstd route block of {len(data)} bytes lacks its frame table")
    sizes = np.frombuffer(data, "<u4", count=layers)
    if table + int(sizes.sum(dtype=np.int64)) != len(data):
        raise InvalidArgument("zstd route block: frame sizes disagree with the block's length")
    out = np.empty(shape, dtype)
    layer_bytes = rows * k * dtype.itemsize
    decompressor = zstandard.ZstdDecompressor()
    offset = table
    for j, size in enumerate(sizes.tolist()):
        frame = data[offset : offset + size]
        # Check the size the frame declares before inflating it: zstandard trusts a declared
        # size over max_output_size, so a small frame could otherwise inflate without bound.
        try:
            declared = zstandard.frame_content_size(frame)
        except zstandard.ZstdError as exc:
            raise InvalidArgument(f"route block layer {j}: not a valid zstd frame: {exc}") from None
        if declared != layer_bytes:
            raise InvalidArgument(
                f"route block layer {j} declares {declared} bytes; {rows} rows x top-{k} "
                f"as {dtype} need {layer_bytes}"
            )
        try:
            layer = decompressor.decompress(frame, max_output_size=layer_bytes)
        except zstandard.ZstdError as exc:
            raise InvalidArgument(f"route block layer {j}: not a valid zstd frame: {exc}") from None
        if len(layer) != layer_bytes:
            raise InvalidArgument(
                f"route block layer {j} holds {len(layer)} bytes; {rows} rows x top-{k} "
                f"as {dtype} need {layer_bytes}"
            )
        out[:, j] = np.frombuffer(layer, dtype).reshape(rows, k)
        offset += size
    return out
