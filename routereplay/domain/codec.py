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

import threading
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
import xxhash
import zstandard

from routereplay.domain.jit import HAVE_NUMBA, numba
from routereplay.domain.record import Geometry
from routereplay.errors import DataLoss, InvalidArgument


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


@dataclass(frozen=True)
class BlockHeader:
    """What a writer announces of a block before sending its bytes: the rows it holds
    (``[row_start, row_start + num_rows)`` of the record), their encoding, size and checksum.

    ``parts``: set when the block comes layer-major, one ``(size, checksum)`` per MoE layer
    (``LayerParts`` back to back, as the route cache stores them); ``checksum`` is then 0.
    """

    row_start: int
    num_rows: int
    encoding: Encoding
    encoded_size: int
    checksum: int
    parts: tuple[tuple[int, int], ...] | None = None


def checksum(data: bytes | memoryview) -> int:
    return xxhash.xxh3_64_intdigest(data)


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
    offset = table
    for j, size in enumerate(sizes.tolist()):
        layer = _inflate_layer(data[offset : offset + size], j, rows, k, dtype)
        out[:, j] = np.frombuffer(layer, dtype).reshape(rows, k)
        offset += size
    return out


_DECOMPRESSOR = threading.local()


def _inflate_layer(frame, j: int, rows: int, k: int, dtype: np.dtype) -> bytes:
    """One layer's zstd frame back to its ``[rows, k]`` bytes, refusing a frame that declares
    or holds another size."""
    layer_bytes = rows * k * dtype.itemsize
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
    decompressor = getattr(_DECOMPRESSOR, "value", None)
    if decompressor is None:  # one per thread: a ZstdDecompressor is not thread-safe
        decompressor = _DECOMPRESSOR.value = zstandard.ZstdDecompressor()
    try:
        layer = decompressor.decompress(frame, max_output_size=layer_bytes)
    except zstandard.ZstdError as exc:
        raise InvalidArgument(f"route block layer {j}: not a valid zstd frame: {exc}") from None
    if len(layer) != layer_bytes:
        raise InvalidArgument(
            f"route block layer {j} holds {len(layer)} bytes; {rows} rows x top-{k} "
            f"as {dtype} need {layer_bytes}"
        )
    return layer


@dataclass(frozen=True)
class LayerParts:
    """A block's routes split by MoE layer, as the route cache stores and sends them.

    ``parts[i]`` holds route column ``layers[i]`` (a position in ``geometry.moe_layers``):
    its ``[num_rows, k]`` ids row-major (RAW) or one zstd frame of them (ZSTD), with the
    xxh3-64 ``checksums[i]`` of those bytes. A layer selection is served by sending only
    its parts; each part is verified and decoded on its own.
    """

    encoding: Encoding
    num_rows: int
    layers: tuple[int, ...]
    parts: tuple[bytes | memoryview, ...]
    checksums: tuple[int, ...]

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(len(p) for p in self.parts)

    def select(self, layers: tuple[int, ...]) -> LayerParts:
        """The parts of ``layers``, a subset of ``self.layers`` in ascending order."""
        index = {layer: i for i, layer in enumerate(self.layers)}
        picked = [index[layer] for layer in layers]
        return LayerParts(
            self.encoding,
            self.num_rows,
            tuple(layers),
            tuple(self.parts[i] for i in picked),
            tuple(self.checksums[i] for i in picked),
        )


def split_layers(encoded: EncodedRoutes, geometry: Geometry) -> LayerParts:
    """The per-layer parts of a block that was checked (checksum, shape) already.

    RAW: one transposing copy to layer-major ``[L, rows, k]``, then views of it. ZSTD: the
    frames are per layer already; views of them, no decompression.
    """
    layers = tuple(range(geometry.num_moe_layers))
    data = memoryview(encoded.data)
    if encoded.encoding is Encoding.ZSTD:
        sizes = np.frombuffer(encoded.data, "<u4", count=len(layers)).tolist()
        offsets = np.cumsum([4 * len(layers), *sizes]).tolist()
        parts = tuple(data[offsets[j] : offsets[j + 1]] for j in layers)
    else:
        shape = (encoded.num_rows, len(layers), geometry.topk)
        routes = np.frombuffer(encoded.data, geometry.dtype).reshape(shape)
        return raw_layer_parts(swap_first_axes(routes))
    return LayerParts(
        encoded.encoding, encoded.num_rows, layers, parts, tuple(checksum(p) for p in parts)
    )


def encode_layer_parts(
    routes: np.ndarray, encoding: Encoding = Encoding.RAW, level: int = 1
) -> LayerParts:
    """Encode ``routes`` ``[rows, L, k]`` layer by layer: RAW as views of one layer-major
    copy, ZSTD as one frame per layer (RAW instead when that is not smaller). What clients
    send, and what the route cache stores, as it comes."""
    routes = np.ascontiguousarray(routes)
    if encoding is Encoding.ZSTD and routes.size:
        compressor = zstandard.ZstdCompressor(level=level)
        frames = tuple(
            compressor.compress(np.ascontiguousarray(routes[:, j])) for j in range(routes.shape[1])
        )
        if sum(len(f) for f in frames) < routes.nbytes:
            return LayerParts(
                Encoding.ZSTD,
                int(routes.shape[0]),
                tuple(range(routes.shape[1])),
                frames,
                tuple(checksum(f) for f in frames),
            )
    return raw_layer_parts(swap_first_axes(routes))


def contiguous(parts: LayerParts) -> bytes | memoryview:
    """The parts back to back: a view of the buffer they are consecutive slices of, when they
    are (the received block; one layer-major copy), else a joined copy."""
    views = parts.parts
    total = sum(len(p) for p in views)
    if total and all(isinstance(p, memoryview) for p in views):
        try:
            whole = memoryview(views[0].obj).cast("B")
            addresses = [_address(p) for p in views]
        except (TypeError, ValueError):
            return b"".join(views)
        start = addresses[0] - _address(whole)
        consecutive = all(
            b - a == len(p) for a, b, p in zip(addresses, addresses[1:], views, strict=False)
        )
        if consecutive and all(p.obj is views[0].obj for p in views) and 0 <= start:
            if start + total <= len(whole):
                return whole[start : start + total]
    return b"".join(views)


def _address(view: memoryview) -> int:
    return np.frombuffer(view, np.uint8).__array_interface__["data"][0]


def raw_layer_parts(major: np.ndarray) -> LayerParts:
    """The RAW layer parts of a contiguous layer-major ``[L, rows, k]`` array (views)."""
    num_layers, rows = major.shape[:2]
    flat = memoryview(major.reshape(-1).view(np.uint8))
    size = flat.nbytes // num_layers if num_layers else 0
    parts = tuple(flat[j * size : (j + 1) * size] for j in range(num_layers))
    return LayerParts(
        Encoding.RAW, rows, tuple(range(num_layers)), parts, tuple(checksum(p) for p in parts)
    )


def swap_first_axes(routes: np.ndarray, use_numba: bool | None = None) -> np.ndarray:
    """``[a, b, k]`` -> a contiguous ``[b, a, k]`` copy, moving each top-k as one wide item
    (uint64 for top-8 uint8): numpy's strided copy of wide items is 3x faster than its
    element-wise transpose, and a tiled numba kernel (where a top-k is one item) 1.5x faster
    again at 32K tokens: 2.2 against 3.4 ms for a Qwen3-30B-A3B block (equal at 4K tokens,
    where the block fits in cache). ``use_numba``: force a path (tests)."""
    a, b, k = routes.shape
    out = np.empty((b, a, k), routes.dtype)
    width = k * routes.dtype.itemsize
    item = next(
        t for t in (np.uint64, np.uint32, np.uint16, np.uint8) if width % np.dtype(t).itemsize == 0
    )
    n = width // np.dtype(item).itemsize
    wide = np.ascontiguousarray(routes).view(item).reshape(a, b, n)
    if (HAVE_NUMBA if use_numba is None else use_numba) and n == 1:
        _swap_tiles(wide.reshape(a, b), out.view(item).reshape(b, a))
    else:
        np.copyto(out.view(item).reshape(b, a, n), wide.transpose(1, 0, 2))
    return out


# Source rows per tile of the swap: a tile's rows stay in cache while each of the b output
# rows is written in order (1024 was the fastest of 64-2048, for 48 layers).
_SWAP_TILE_ROWS = 1024

if HAVE_NUMBA:

    @numba.njit(nogil=True, cache=True)
    def _swap_tiles(src, dst):  # pragma: no cover - compiled
        a, b = src.shape
        for start in range(0, a, _SWAP_TILE_ROWS):
            stop = min(start + _SWAP_TILE_ROWS, a)
            for j in range(b):
                for i in range(start, stop):
                    dst[j, i] = src[i, j]


def join_layers(parts: LayerParts, geometry: Geometry) -> EncodedRoutes:
    """The whole block in the single-block wire form (row-major RAW, or the ZSTD frame table
    and frames), for readers that do not ask for per-layer parts. ``parts`` holds every
    layer and was verified by the caller or is sent on to a reader who verifies it."""
    if parts.encoding is Encoding.ZSTD:
        data = np.array(parts.sizes, "<u4").tobytes() + b"".join(parts.parts)
    else:
        shape = (len(parts.layers), parts.num_rows, geometry.topk)
        major = np.frombuffer(b"".join(parts.parts), geometry.dtype).reshape(shape)
        data = swap_first_axes(major).tobytes()
    return EncodedRoutes(parts.encoding, data, checksum(data), parts.num_rows)


def decode_layer_parts(
    parts: LayerParts, geometry: Geometry, joined: bytes | memoryview | None = None
) -> np.ndarray:
    """Verify each part's checksum and decode into ``[num_rows, len(parts.layers), k]``.

    ``joined``: the parts' bytes back to back, when the caller holds them so (a read's
    block). RAW then decodes without a copy: a read-only, layer-major strided view of it.

    Raises:
        DataLoss: a part's checksum does not match its bytes (names the layer).
        InvalidArgument: a part does not hold ``num_rows`` rows of one layer.
    """
    rows, k, dtype = parts.num_rows, geometry.topk, geometry.dtype
    layer_bytes = rows * k * dtype.itemsize
    for layer, data, expected in zip(parts.layers, parts.parts, parts.checksums, strict=True):
        if checksum(data) != expected:
            raise DataLoss(
                f"route checksum mismatch in MoE layer index {layer} ({len(data)} bytes, "
                f"{rows} rows)"
            )
        if parts.encoding is Encoding.RAW and len(data) != layer_bytes:
            raise InvalidArgument(
                f"route part of MoE layer index {layer} holds {len(data)} bytes; {rows} "
                f"rows x top-{k} as {dtype} need {layer_bytes}"
            )
    shape = (len(parts.layers), rows, k)
    if parts.encoding is Encoding.RAW:
        if joined is None:
            joined = b"".join(parts.parts)
        major = np.frombuffer(joined, dtype, count=shape[0] * shape[1] * shape[2]).reshape(shape)
        return major.transpose(1, 0, 2)
    out = np.empty((rows, len(parts.layers), k), dtype)
    for i, (layer, data) in enumerate(zip(parts.layers, parts.parts, strict=True)):
        layer_data = _inflate_layer(data, layer, rows, k, dtype)
        out[:, i] = np.frombuffer(layer_data, dtype).reshape(rows, k)
    return out
