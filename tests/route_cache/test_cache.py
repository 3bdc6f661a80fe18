"""The route cache's core without gRPC: domain objects in, the same records and refusals as
through the service (which the other tests of this folder check end to end)."""

from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from route_cache.cache import BlockWrite, RouteCache
from route_cache.config import Config
from routereplay.dev.synthetic import synthetic_routes
from routereplay.domain.codec import BlockHeader, decode_layer_parts
from routereplay.domain.record import Missing, Turn
from routereplay.errors import InvalidArgument, NotFound, ResourceExhausted
from tests.route_cache.conftest import SMALL
from tests.support.records import encode_routes


def _write(sample_id, routes, tokens, append=False, row_offset=0, encoded=None, turns=None):
    encoded = encoded or encode_routes(routes)
    header = BlockHeader(
        row_offset, routes.shape[0], encoded.encoding, len(encoded.data), encoded.checksum
    )
    start = row_offset + 1 if append else 0
    turns = turns or [Turn(start, start + tokens, start, 0, np.zeros(0, np.float32))]
    write = BlockWrite(
        sample_id,
        SMALL,
        np.arange(tokens, dtype=np.int32),
        turns,
        header,
        append=append,
        row_offset=row_offset,
    )
    return write, encoded.data


def _pieces(data: bytes, size: int = 100):
    return [data[i : i + size] for i in range(0, len(data), size)] or [b""]


def _routes(record) -> np.ndarray:
    blocks = [decode_layer_parts(b.routes, record.geometry) for b in record.blocks]
    return np.concatenate(blocks)


def test_write_append_and_read_back(store, rng, sid):
    registry = CollectorRegistry()
    cache = RouteCache(store, Config(), registry=registry)
    first, second = synthetic_routes(SMALL, 9, rng), synthetic_routes(SMALL, 4, rng)
    sample = sid()
    write, data = _write(sample, first, 10)
    stored = cache.write(write, _pieces(data))
    assert (stored.num_rows, stored.duplicate) == (9, False)
    assert cache.write(write, _pieces(data)).duplicate  # a retry
    append, data = _write(sample, second, 4, append=True, row_offset=9)
    assert cache.write(append, _pieces(data)).num_rows == 13
    record = cache.read(sample)
    np.testing.assert_array_equal(_routes(record), np.concatenate([first, second]))
    selected = cache.read(sample, [1, 3])
    np.testing.assert_array_equal(_routes(selected), np.concatenate([first, second])[:, [1, 3]])
    committed = {"call": "append", "duplicate": "false"}
    assert registry.get_sample_value("route_cache_records_committed_total", committed) == 1


@pytest.mark.parametrize(
    "fault, message",
    [
        ("bytes", "the route bytes hold"),
        ("checksum", "changed in transit"),
        ("rows", "block covers rows"),
        ("ids", "expert ids repeat"),
        ("chunks", "max_write_chunks"),
    ],
)
def test_refused_writes_store_nothing(store, rng, sid, fault, message):
    registry = CollectorRegistry()
    cache = RouteCache(store, Config(max_write_chunks=4), registry=registry)
    routes = synthetic_routes(SMALL, 9, rng)
    sample = sid()
    if fault == "ids":
        routes = routes.copy()
        routes[3, 2, :2] = 7  # a repeated id within one top-k
    write, data = _write(sample, routes, 10)
    pieces = [data]
    if fault == "bytes":
        pieces = [data[:-1]]
    elif fault == "checksum":
        pieces = [bytes([data[0] ^ 1]) + data[1:]]
    elif fault == "rows":
        write, _ = _write(sample, routes, 11)
    elif fault == "chunks":
        pieces = _pieces(data, len(data) // 5)
    error = ResourceExhausted if fault == "chunks" else InvalidArgument
    with pytest.raises(error, match=message):
        cache.write(write, pieces)
    with pytest.raises(NotFound):
        cache.read(sample)
    refused = {"call": "write", "code": error.status}
    assert registry.get_sample_value("route_cache_records_refused_total", refused) == 1


def test_batch_reads_name_the_missing(store, rng, sid):
    cache = RouteCache(store, Config(max_batch=3))
    sample = sid()
    write, data = _write(sample, synthetic_routes(SMALL, 5, rng), 6)
    cache.write(write, [data])
    absent = sid()
    got = list(cache.read_many([sample, absent], skip_missing=True))
    assert got[0].sample_id == sample and got[1] == Missing(absent)
    with pytest.raises(NotFound, match=absent):
        list(cache.read_many([sample, absent]))
    with pytest.raises(InvalidArgument, match="sample_ids has 4 ids; the limit is 3"):
        list(cache.read_many([sample] * 4))
    with pytest.raises(InvalidArgument, match="layers.indices repeats"):
        list(cache.read_many([sample], [1, 1]))
