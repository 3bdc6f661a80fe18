"""The Redis layout (storage format 3: a hash of small fields and a string of layer-major
route bytes per record) and its atomicity, on a real single node and a real 3-master
cluster."""

from __future__ import annotations

import numpy as np
import pytest
import redis

from route_cache.connection import connect
from route_cache.record_format import StoredBlock, record_key, routes_key
from route_cache.store import RouteStore
from routereplay.dev.synthetic import synthetic_routes
from routereplay.domain.codec import join_layers
from routereplay.domain.record import Turn
from routereplay.errors import (
    AlreadyExists,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
)
from tests.route_cache.conftest import SMALL, raw_keys
from tests.support.records import encode_routes


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


def test_a_record_is_two_keys_in_one_slot_expiring_together(redis_client, rng, sid):
    store = RouteStore(redis_client, ttl_ms=3_600_000)  # not the staging key's 10 minutes
    sample = sid()
    keys = sorted({record_key(sample).encode(), routes_key(sample).encode()})
    store.write(sample, "", SMALL, block(rng, 0, 10))
    assert all(3_590_000 < redis_client.pttl(k) <= 3_600_000 for k in keys)
    redis_client.pexpire(keys[0], 1_000_000)
    redis_client.pexpire(keys[1], 1_000_000)
    store.append(sample, SMALL, block(rng, 9, 4))  # an append sets both again
    assert all(3_590_000 < redis_client.pttl(k) <= 3_600_000 for k in keys)
    assert set(raw_keys(redis_client, f"*{sample}*")) == set(keys)  # no staging key left
    if isinstance(redis_client, redis.cluster.RedisCluster):
        assert len({redis_client.keyslot(k) for k in keys}) == 1
    # The routes: every block layer-major, back to back (9 rows, then 4).
    value = redis_client.get(routes_key(sample))
    record = store.read(sample)
    assert value == b"".join(b"".join(b.routes.parts) for b in record.blocks)
    assert len(value) == 13 * SMALL.row_bytes
    store.delete(sample)
    assert raw_keys(redis_client, f"*{sample}*") == []


def test_records_kept_without_ttl_have_no_expiry_on_either_key(redis_client, rng, sid):
    store = RouteStore(redis_client, ttl_ms=0)
    sample = sid()
    store.write(sample, "", SMALL, block(rng, 0, 10))  # the routes come from an expiring stage
    store.append(sample, SMALL, block(rng, 9, 4))
    assert redis_client.pttl(record_key(sample)) == -1
    assert redis_client.pttl(routes_key(sample)) == -1


def _commands(client) -> dict[str, int]:
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): v["calls"] for name, v in stats.items()}


def _counted(client, action) -> dict[str, int]:
    """The Redis commands ``action()`` sent (a single node's command statistics)."""
    before = _commands(client)
    action()
    after = _commands(client)
    delta = {k: after[k] - before.get(k, 0) for k in after}
    return {k: v for k, v in delta.items() if v and k not in ("info", "ping")}


def test_the_commands_of_writes_and_reads(redis_node, rng, sid):
    """A write is one SET and the commit script; a whole read one GET (and the small
    fields); a stage read one GETRANGE per block."""
    client = connect(redis_node.url, cluster=False)
    store = RouteStore(client, ttl_ms=600_000)
    sample = sid()
    assert _counted(client, lambda: store.write(sample, "", SMALL, block(rng, 0, 10))) == {
        "set": 1,
        "evalsha": 1,
        "hset": 1,
        "exists": 2,
        "strlen": 1,
        "rename": 1,
        "pexpire": 2,
    }
    store.append(sample, SMALL, block(rng, 9, 4))
    assert _counted(client, lambda: store.read(sample)) == {"get": 1, "hget": 1, "hgetall": 1}
    stage = _counted(client, lambda: store.read(sample, layers=(1, 2)))
    assert stage == {"hgetall": 1, "getrange": 2, "hget": 1}  # two blocks
    split = _counted(client, lambda: store.read(sample, layers=(0, 2, 3)))
    assert split["getrange"] == 4  # two runs of layers in each block


def test_a_stage_read_fetches_from_redis_only_the_stages_bytes(redis_node, rng, sid):
    client = connect(redis_node.url, cluster=False)
    store = RouteStore(client, ttl_ms=600_000)
    sample = sid()
    big = StoredBlock(
        0,
        0,
        np.arange(20_001, dtype=np.int32),
        [Turn(0, 20_001, 1)],
        encode_routes(synthetic_routes(SMALL, 20_000, rng)),
    )
    store.write(sample, "", SMALL, big)

    def sent(action) -> int:
        before = client.info("stats")["total_net_output_bytes"]
        action()
        return client.info("stats")["total_net_output_bytes"] - before

    whole = sent(lambda: store.read(sample))
    stage = sent(lambda: store.read(sample, layers=(1,)))
    layer_bytes = 20_000 * SMALL.topk
    assert whole > 5 * layer_bytes
    assert layer_bytes <= stage < layer_bytes + 100_000  # + tokens and small fields (80 KB)


def _flush_scripts(client) -> None:
    if isinstance(client, redis.cluster.RedisCluster):
        for node in client.get_primaries():
            client.get_redis_connection(node).script_flush()
    else:
        client.script_flush()


def test_writes_and_appends_survive_redis_forgetting_the_scripts(store, redis_client, rng, sid):
    sample = sid()
    store.write(sample, "", SMALL, block(rng, 0, 10))
    _flush_scripts(redis_client)  # a restart, or a failover to a replica without them
    assert store.append(sample, SMALL, block(rng, 9, 4)) == (False, 13)
    _flush_scripts(redis_client)
    other = sid()
    assert store.write(other, "", SMALL, block(rng, 0, 6)) is False
    assert store.read(other).num_rows == 5


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
    got = list(store.read_many(ids))  # batch_window=3: windows of 1, 3 and 3 records
    assert [r.sample_id if r else None for r in got] == [
        s if i % 2 == 0 else None for i, s in enumerate(ids)
    ]


def test_whole_reads_fetch_windows_of_batch_bytes_at_the_largest_record_so_far(
    redis_client, rng, sid, monkeypatch
):
    """The first window is one record; the next hold what fits in ``batch_bytes`` at the
    largest record read so far, at most ``batch_window``; every record comes back in order."""
    small, large = block(rng, 0, 10), block(rng, 0, 40)  # large: 4x the route bytes
    size = len(small.routes.data)  # RAW: the bytes stored
    store = RouteStore(redis_client, batch_bytes=3 * size, batch_window=16)
    ids = [sid() for _ in range(12)]
    for i, sample in enumerate(ids):
        store.write(sample, "", SMALL, large if i == 5 else small)
    windows = []
    fetch = store._fetch
    monkeypatch.setattr(
        store, "_fetch", lambda window, layers: windows.append(len(window)) or fetch(window, layers)
    )
    got = list(store.read_many(ids))
    assert [r.sample_id for r in got] == ids
    # 1, then 3 small records' worth; the large one (in the third window) leaves room for one.
    assert windows == [1, 3, 3, 1, 1, 1, 1, 1]

    windows.clear()
    store.batch_window = 2
    assert [r.sample_id for r in store.read_many(ids[:6])] == ids[:6]
    assert windows == [1, 2, 2, 1]


def _between_the_steps(monkeypatch, action):
    """Run ``action`` between a layer-selected read's two steps (the small fields, then the
    ranges): the interleaving of a concurrent writer, injected at the one point where it
    matters."""
    from route_cache import record_format

    head = record_format.stage_head
    done = []

    def interleaved(sample_id, fields, layers):
        if not done:
            done.append(action())
        return head(sample_id, fields, layers)

    monkeypatch.setattr(record_format, "stage_head", interleaved)


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


def test_a_layer_read_finds_the_new_record_when_the_id_is_rewritten_midway(
    store, rng, sid, monkeypatch
):
    """Deleted and written again between the two steps: the read starts again and returns
    the new record whole, never the old record's small fields over the new one's routes."""
    sample = sid()
    store.write(sample, "", SMALL, block(rng, 0, 10))
    new = block(rng, 0, 30)

    def rewrite():
        store.delete(sample)
        store.write(sample, "", SMALL, new)

    _between_the_steps(monkeypatch, rewrite)
    got = store.read(sample, layers=(1, 2))
    assert got.num_rows == 29
    np.testing.assert_array_equal(got.token_ids, new.token_ids)
    expected = join_layers(store.read(sample).blocks[0].routes, SMALL)
    assert expected == new.routes
    assert got.blocks[0].routes.parts == store.read(sample).blocks[0].routes.select((1, 2)).parts


def test_a_whole_read_leaves_out_blocks_appended_after_its_get_and_retries_a_rewrite(
    store, rng, sid
):
    """A whole read's three commands (gen, the routes, the small fields) see the routes
    before an append's small fields, or the id rewritten in between."""
    from route_cache import record_format

    sample = sid()
    store.write(sample, "", SMALL, block(rng, 0, 10))
    client = store.client
    gen = client.hget(record_key(sample), "gen")
    value = client.get(routes_key(sample))
    store.append(sample, SMALL, block(rng, 9, 4))
    fields = client.hgetall(record_key(sample))
    record = record_format.whole_record(sample, gen, value, fields)
    assert record.num_rows == 9 and [b.row_start for b in record.blocks] == [0]
    assert record_format.whole_record(sample, b"another", value, fields) is record_format.CHANGED
    assert record_format.whole_record(sample, gen, None, fields) is None  # routes expired
    with pytest.raises(DataLoss, match="its routes hold"):
        record_format.whole_record(sample, gen, value[:-1], fields)


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
