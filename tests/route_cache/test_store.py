"""The Redis layout and its atomicity, on a real single node and a real 3-master cluster."""

from __future__ import annotations

import numpy as np
import pytest
import redis

from route_cache.store import RouteStore, StoredBlock, record_key
from routereplay.dev.synthetic import synthetic_routes
from routereplay.domain.codec import encode_routes, join_layers
from routereplay.domain.record import Turn
from routereplay.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from tests.route_cache.conftest import SMALL, raw_keys


def block(rng, row_start, num_tokens, version=0):
    """A block of ``num_tokens`` tokens; a first block has one row fewer than tokens."""
    token_start = 0 if row_start == 0 else row_start + 1
    rows = num_tokens - 1 if row_start == 0 else num_tokens
    end = token_start + num_tokens
    turn = Turn(token_start, end, end - 2, version, np.full(2, -0.5, np.float32))
    return StoredBlock(
        row_start,
        token_start,
        rng.integers(0, 1000, num_tokens, dtype=np.int32),
        [turn],
        encode_routes(synthetic_routes(SMALL, rows, rng)),
    )


def test_write_then_read(store, rng, sid):
    sample = sid()
    first = block(rng, 0, 10)
    assert store.write(sample, "g1", SMALL, first) is False
    record = store.read(sample)
    assert record.geometry == SMALL and record.group_id == "g1" and record.num_rows == 9
    np.testing.assert_array_equal(record.token_ids, first.token_ids)
    # Stored per MoE layer; reassembled whole it is the block that was written.
    assert join_layers(record.blocks[0].routes, SMALL) == first.routes
    np.testing.assert_array_equal(record.turns[0].logprobs, [-0.5, -0.5])


def test_a_record_is_one_key_in_one_slot(store, redis_client, rng, sid):
    sample = sid()
    store.write(sample, "", SMALL, block(rng, 0, 10))
    store.append(sample, SMALL, block(rng, 9, 4))
    assert raw_keys(redis_client, f"*{sample}*") == [record_key(sample).encode()]
    assert redis_client.ttl(record_key(sample)) > 0  # expiry is configured


def test_identical_write_is_idempotent_and_different_is_refused(store, rng, sid):
    sample = sid()
    first = block(rng, 0, 10)
    store.write(sample, "", SMALL, first)
    assert store.write(sample, "", SMALL, first) is True
    with pytest.raises(AlreadyExists, match=sample):
        store.write(sample, "", SMALL, block(rng, 0, 10))
    with pytest.raises(AlreadyExists):
        store.write(sample, "other-group", SMALL, first)


def test_append_at_the_row_count_retry_and_stale(store, rng, sid):
    sample = sid()
    store.write(sample, "", SMALL, block(rng, 0, 10))  # 10 tokens, 9 rows
    second = block(rng, 9, 5, version=1)
    assert store.append(sample, SMALL, second) == (False, 14)
    assert store.append(sample, SMALL, second) == (True, 14)  # a retry changes nothing
    with pytest.raises(FailedPrecondition, match="has 14 rows"):
        store.append(sample, SMALL, block(rng, 9, 5))  # stale: same offset, other data
    with pytest.raises(FailedPrecondition, match="row_offset 20"):
        store.append(sample, SMALL, block(rng, 20, 2))  # a gap
    record = store.read(sample)
    assert record.num_rows == 14 and record.token_ids.size == 15
    assert [t.policy_version for t in record.turns] == [0, 1]


def test_append_needs_the_record_and_its_geometry(store, rng, sid):
    with pytest.raises(NotFound):
        store.append(sid(), SMALL, block(rng, 9, 5))
    sample = sid()
    store.write(sample, "", SMALL, block(rng, 0, 10))
    other = type(SMALL)(SMALL.moe_layers, SMALL.topk, SMALL.num_experts, "another-model")
    with pytest.raises(InvalidArgument, match="geometry differs"):
        store.append(sample, other, block(rng, 9, 5))


def test_read_many_keeps_the_order_and_marks_missing(store, rng, sid):
    ids = [sid() for _ in range(7)]
    for sample in ids[::2]:
        store.write(sample, "", SMALL, block(rng, 0, 6))
    got = list(store.read_many(ids))  # batch_window=3: three round trips
    assert [r.sample_id if r else None for r in got] == [
        s if i % 2 == 0 else None for i, s in enumerate(ids)
    ]


def _between_the_steps(monkeypatch, action):
    """Run ``action`` between a layer-selected read's HKEYS and its HMGET: the interleaving
    of a concurrent writer, injected at the one point where it matters."""
    from route_cache import store as store_module

    pick = store_module._selected_fields

    def interleaved(names, layers):
        action()
        return pick(names, layers)

    monkeypatch.setattr(store_module, "_selected_fields", interleaved)


def test_a_layer_read_sees_the_record_as_it_was_when_an_append_lands_midway(
    store, rng, sid, monkeypatch
):
    sample = sid()
    store.write(sample, "", SMALL, block(rng, 0, 10))
    whole = store.read(sample)
    _between_the_steps(monkeypatch, lambda: store.append(sample, SMALL, block(rng, 9, 5)))
    got = store.read(sample, layers=(1,))
    assert got.num_rows == 9 and [b.row_start for b in got.blocks] == [0]
    assert got.blocks[0].routes.parts == whole.blocks[0].routes.select((1,)).parts
    monkeypatch.undo()
    assert store.read(sample).num_rows == 14  # the append did land


def test_a_layer_read_finds_no_record_when_a_delete_lands_midway(store, rng, sid, monkeypatch):
    gone, kept = sid(), sid()
    for sample in (gone, kept):
        store.write(sample, "", SMALL, block(rng, 0, 10))
    _between_the_steps(monkeypatch, lambda: store.client.delete(record_key(gone)))
    got = list(store.read_many([gone, kept, sid()], layers=(0, 2)))  # and one never written
    assert got[0] is None and got[1].sample_id == kept and got[1].layers == (0, 2)
    assert got[2] is None


def test_stat_and_delete(store, rng, sid):
    sample = sid()
    store.write(sample, "", SMALL, block(rng, 0, 10))
    stat = store.stat(sample)
    assert stat.num_tokens == 10 and stat.record.num_rows == 9
    assert stat.stored_bytes > 9 * SMALL.row_bytes and 0 < stat.ttl_ms <= 600_000
    assert set(stat.record.blocks[0].routes.parts) == {b""}  # no payload
    # ... but the stored route fields' sizes: 9 rows x k ids of one byte, per MoE layer.
    assert stat.block_sizes == [(9 * SMALL.topk,) * SMALL.num_moe_layers]
    assert stat.route_bytes == 9 * SMALL.row_bytes
    store.delete(sample)
    with pytest.raises(NotFound):
        store.read(sample)
    with pytest.raises(NotFound):
        store.delete(sample)


def test_unreachable_redis_is_unavailable(rng):
    from routereplay.errors import Unavailable

    client = redis.Redis(port=1, socket_connect_timeout=0.2)
    store = RouteStore(client)
    assert store.ping() is False
    with pytest.raises(Unavailable, match="redis is unreachable"):
        store.write("x", "", SMALL, block(rng, 0, 3))
