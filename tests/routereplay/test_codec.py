"""The route block codec and the route checks, by properties over random geometries."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from routereplay.dev.synthetic import synthetic_routes
from routereplay.domain import codec
from routereplay.domain.codec import (
    EncodedRoutes,
    Encoding,
    checksum,
    decode_layer_parts,
    decode_routes,
    join_layers,
    split_layers,
)
from routereplay.domain.record import Geometry, check_routes
from routereplay.errors import DataLoss, InvalidArgument
from tests.support.records import encode_routes


@st.composite
def geometries(draw):
    num_experts = draw(st.sampled_from([2, 8, 64, 128, 256, 257, 300, 1024]))
    topk = draw(st.integers(1, min(num_experts, 8)))
    first = draw(st.integers(0, 3))
    layers = tuple(range(first, first + draw(st.integers(1, 6))))
    return Geometry(layers, topk, num_experts)


@st.composite
def routes_of(draw):
    geometry = draw(geometries())
    rows = draw(st.integers(0, 64))
    seed = draw(st.integers(0, 2**32 - 1))
    skew = draw(st.sampled_from([0.0, 1.2]))
    return geometry, synthetic_routes(geometry, rows, np.random.default_rng(seed), skew)


@settings(max_examples=60, deadline=None)
@given(routes_of(), st.sampled_from(list(Encoding)))
def test_round_trip(case, encoding):
    geometry, routes = case
    check_routes(routes, geometry, routes.shape[0])  # the generator makes valid routes
    encoded = encode_routes(routes, encoding)
    decoded = decode_routes(encoded, geometry)
    assert decoded.dtype == geometry.dtype
    np.testing.assert_array_equal(decoded, routes)
    # Compression is used only when it shrinks the block.
    assert len(encoded.data) <= routes.nbytes


@settings(max_examples=60, deadline=None)
@given(routes_of(), st.sampled_from(list(Encoding)), st.data())
def test_layer_parts_round_trip_and_select(case, encoding, data):
    """Split per layer (as stored), any ascending selection decodes to those columns, and
    the parts join back into the very block that was split."""
    geometry, routes = case
    encoded = encode_routes(routes, encoding)
    parts = split_layers(encoded, geometry)
    assert parts.layers == tuple(range(geometry.num_moe_layers))
    np.testing.assert_array_equal(decode_layer_parts(parts, geometry), routes)
    assert join_layers(parts, geometry) == encoded
    chosen = data.draw(st.lists(st.sampled_from(parts.layers), min_size=1, unique=True))
    chosen = tuple(sorted(chosen))
    selected = parts.select(chosen)
    np.testing.assert_array_equal(decode_layer_parts(selected, geometry), routes[:, chosen])
    joined = b"".join(selected.parts)  # as a read receives them: decoded as a view
    np.testing.assert_array_equal(decode_layer_parts(selected, geometry, joined), routes[:, chosen])


def test_a_corrupt_layer_part_names_its_layer():
    geometry = Geometry((1, 2, 3), 4, 16)
    parts = split_layers(
        encode_routes(synthetic_routes(geometry, 9, np.random.default_rng(0))), geometry
    )
    corrupt = bytearray(parts.parts[1])
    corrupt[3] ^= 1
    bad = replace(parts, parts=(parts.parts[0], bytes(corrupt), parts.parts[2]))
    with pytest.raises(DataLoss, match="MoE layer index 1"):
        decode_layer_parts(bad, geometry)
    decode_layer_parts(bad.select((0, 2)), geometry)  # the other layers still decode


def test_raw_decodes_without_a_copy():
    geometry = Geometry((0, 1), 2, 8)
    encoded = encode_routes(synthetic_routes(geometry, 10, np.random.default_rng(0)))
    decoded = decode_routes(encoded, geometry)
    assert np.shares_memory(decoded, np.frombuffer(encoded.data, np.uint8))


def test_uint16_is_little_endian():
    routes = np.array([[[258]]], dtype="<u2")
    assert encode_routes(routes).data == b"\x02\x01"


def test_zstd_wins_on_skewed_routes():
    geometry = Geometry(tuple(range(8)), 8, 128)
    routes = synthetic_routes(geometry, 2000, np.random.default_rng(1), skew=1.2)
    encoded = encode_routes(routes, Encoding.ZSTD)
    assert encoded.encoding is Encoding.ZSTD
    # Uniform ids below 128 need 7 of 8 bits; per-layer skew brings it well below that.
    assert len(encoded.data) < 0.8 * routes.nbytes


@settings(max_examples=40, deadline=None)
@given(routes_of(), st.data())
def test_any_flipped_byte_is_caught(case, data):
    geometry, routes = case
    if routes.size == 0:
        return
    encoded = encode_routes(routes, data.draw(st.sampled_from(list(Encoding))))
    corrupt = bytearray(encoded.data)
    corrupt[data.draw(st.integers(0, len(corrupt) - 1))] ^= data.draw(st.integers(1, 255))
    with pytest.raises(DataLoss, match="checksum"):
        decode_routes(
            EncodedRoutes(encoded.encoding, bytes(corrupt), encoded.checksum, encoded.num_rows),
            geometry,
        )


def test_truncated_block_is_refused():
    geometry = Geometry((0, 1), 2, 8)
    encoded = encode_routes(synthetic_routes(geometry, 10, np.random.default_rng(0)))
    short = EncodedRoutes(Encoding.RAW, encoded.data[:-2], checksum(encoded.data[:-2]), 10)
    with pytest.raises(InvalidArgument, match="need 40"):
        decode_routes(short, geometry)


def test_zstd_bomb_is_refused():
    geometry = Geometry((0,), 1, 8)
    frame = zstandard.ZstdCompressor().compress(bytes(1 << 20))
    bomb = np.array([len(frame)], "<u4").tobytes() + frame
    # Refused from the size the frame declares, before inflating it.
    with pytest.raises(InvalidArgument, match="layer 0 declares 1048576 bytes"):
        decode_routes(EncodedRoutes(Encoding.ZSTD, bomb, checksum(bomb), 4), geometry)
    # A block of zero rows: its layers must not inflate either.
    with pytest.raises(InvalidArgument, match="layer 0 declares 1048576 bytes"):
        decode_routes(EncodedRoutes(Encoding.ZSTD, bomb, checksum(bomb), 0), geometry)
    with pytest.raises(InvalidArgument, match="frame sizes"):
        decode_routes(EncodedRoutes(Encoding.ZSTD, bomb[:-1], checksum(bomb[:-1]), 4), geometry)


@settings(max_examples=60, deadline=None)
@given(routes_of(), st.data())
def test_repeated_ids_are_refused_where_they_are(case, data):
    geometry, routes = case
    if routes.size == 0 or geometry.topk < 2:
        return
    bad = routes.copy()
    row = data.draw(st.integers(0, bad.shape[0] - 1))
    layer = data.draw(st.integers(0, geometry.num_moe_layers - 1))
    i, j = data.draw(
        st.lists(st.integers(0, geometry.topk - 1), min_size=2, max_size=2, unique=True)
    )
    bad[row, layer, j] = bad[row, layer, i]
    with pytest.raises(
        InvalidArgument,
        match=rf"routes\[{row}\] layer "
        rf"{geometry.moe_layers[layer]}: expert ids repeat",
    ):
        check_routes(bad, geometry, bad.shape[0])


def test_a_block_of_zeros_is_refused():
    geometry = Geometry((1, 2, 3), 2, 8)
    with pytest.raises(InvalidArgument, match="silent capture failure"):
        check_routes(np.zeros((5, 3, 2), np.uint8), geometry, 5)


@settings(max_examples=40, deadline=None)
@given(routes_of(), st.data())
def test_out_of_range_ids_are_refused(case, data):
    geometry, routes = case
    if routes.size == 0 or geometry.num_experts > np.iinfo(geometry.dtype).max:
        return
    bad = routes.astype(np.int64)
    row = data.draw(st.integers(0, bad.shape[0] - 1))
    bad[row, 0, 0] = data.draw(st.integers(geometry.num_experts, np.iinfo(geometry.dtype).max))
    with pytest.raises(InvalidArgument, match=f"routes\\[{row}\\].*>= num_experts"):
        check_routes(bad.astype(geometry.dtype), geometry, bad.shape[0])


def test_shape_and_dtype_must_match_the_geometry():
    geometry = Geometry((1, 2), 2, 300)
    routes = synthetic_routes(geometry, 4, np.random.default_rng(0))
    with pytest.raises(InvalidArgument, match="shape"):
        check_routes(routes, geometry, 5)
    with pytest.raises(InvalidArgument, match="needs uint16"):
        check_routes(routes.astype(np.uint8), geometry, 4)


@pytest.mark.parametrize("row", [0, 16383, 16384, 30000, 39999])
def test_repeated_ids_are_found_in_every_block_of_a_long_record(row):
    """The id check walks a long record in cache-sized blocks: a repeat in any block, or on a
    block's first or last row, is reported at its own row and layer (4 layers: 16384 rows a
    block)."""
    geometry = Geometry((1, 2, 3, 4), 8, 128)
    routes = synthetic_routes(geometry, 40000, np.random.default_rng(row))
    check_routes(routes, geometry, routes.shape[0])
    layer = 3 if row == 16383 else 0  # the last top-k of a block, or the first of one
    routes[row, layer, 7] = routes[row, layer, 2]
    with pytest.raises(InvalidArgument, match=rf"routes\[{row}\] layer {layer + 1}: "):
        check_routes(routes, geometry, routes.shape[0])


@pytest.mark.parametrize("use_numba", [False, True] if codec.HAVE_NUMBA else [False])
@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(0, 2100),  # across the kernel's 1024-row tiles
    layers=st.integers(1, 7),
    k=st.sampled_from([1, 2, 3, 4, 6, 8]),
    dtype=st.sampled_from([np.uint8, np.dtype("<u2")]),
)
def test_the_layer_swap_is_numpys_transpose(use_numba, rows, layers, k, dtype):
    """Oracle: numpy's own element-wise transpose; both paths (numba's tiled kernel where a
    top-k is one wide item, numpy's strided copy elsewhere)."""
    routes = np.random.default_rng(rows).integers(0, 250, (rows, layers, k)).astype(dtype)
    swapped = codec.swap_first_axes(routes, use_numba)
    assert swapped.flags.c_contiguous and swapped.dtype == routes.dtype
    np.testing.assert_array_equal(swapped, routes.transpose(1, 0, 2))
