"""The run's lifecycle over real gRPC and real Redis: records freed once every commit group
acknowledged them, the ready stream trimmed by consumption and capped by refusal, and writes
refused at the memory budget, whole, until the trainer catches up (docs/route_cache.md,
"Lifecycle")."""

from __future__ import annotations

import time

import pytest
from redis.cluster import key_slot

from route_cache.feed import ReadyFeed
from route_cache.record_format import freeing_key, record_key, routes_key, settled_key
from routereplay.dev.redis_nodes import RedisProcess
from routereplay.dev.synthetic import synthetic_record
from routereplay.errors import NotFound, ResourceExhausted, Unavailable
from tests.route_cache.conftest import SMALL
from tests.route_cache.test_feed import Feed


def _entries(feed: Feed) -> list[str]:
    return [
        sample
        for _, fields in feed.redis.xrange(feed.stream)
        for sample in [fields[b"sample_id"].decode()]
    ]


def test_a_record_is_freed_once_every_commit_group_acknowledged_it(store, rng, sid):
    """Declared groups ``a`` and ``b``: ``a``'s acknowledgement (and ``c``'s, undeclared)
    leaves the record whole; ``b``'s frees it after the grace, and a repeat changes nothing."""
    feed = Feed(store, commit_groups="a,b", free_grace_s=0.5)
    try:
        record = feed.write(rng, sid())
        keys = (record_key(record.sample_id), routes_key(record.sample_id))
        for group in ("a", "c"):
            consumer = feed.consumer(group, group=group)
            assert len(consumer.settle(consumer.next_groups(1, timeout_s=2))) == 1
            assert feed.client.stat(record.sample_id).sample_id == record.sample_id
            assert all(feed.redis.pttl(k) > 60_000 for k in keys), group
        last = feed.consumer("b", group="b")
        assert len(last.settle(last.next_groups(1, timeout_s=2))) == 1
        assert all(0 < feed.redis.pttl(k) <= 500 for k in keys)
        assert feed.server.feed.freed == 1
        feed.client.ack_ready("b", [feed.redis.xrange(feed.stream)[0][0].decode()], "b")
        assert all(0 < feed.redis.pttl(k) <= 500 for k in keys)  # not lengthened again
        time.sleep(0.6)
        with pytest.raises(NotFound):
            feed.client.stat(record.sample_id)
    finally:
        feed.close()


def test_trim_drops_only_what_every_group_acknowledged(store, rng, sid):
    """Group ``a`` acknowledges all 6 entries; ``b`` has 4 delivered, the 2nd of them still
    pending. The trim keeps from ``b``'s pending entry on: the 1st entry goes, nothing else."""
    feed = Feed(store, commit_groups="a,b")
    try:
        samples = [feed.write(rng, sid()).sample_id for _ in range(6)]
        feed.server.feed.keep_acked_ms = 0  # the retry window, tested below
        assert feed.server.feed.trim() == 0  # b has not read: nothing is everybody's yet
        a = feed.consumer("a", group="a")
        assert len(a.settle(a.next_groups(6, timeout_s=2))) == 6
        assert feed.server.feed.trim() == 0  # b (declared) does not exist yet
        page = feed.client.read_ready("b", "b0", max_entries=4)
        acked = [e.entry_id for e in page.entries if e.sample_id != samples[1]]
        feed.client.ack_ready("b", acked, "b0")
        assert feed.server.feed.trim() == 1
        assert _entries(feed) == samples[1:]
        feed.client.ack_ready("b", [page.entries[1].entry_id], "b0")
        feed.server.feed.keep_acked_ms = 60_000  # entries this young stay, acknowledged or not
        assert feed.server.feed.trim() == 0
        feed.server.feed.keep_acked_ms = 0
        assert feed.server.feed.trim() == 3  # up to b's first undelivered entry
        assert _entries(feed) == samples[4:]
    finally:
        feed.close()


def test_the_stream_refuses_announcements_at_its_cap(store, rng, sid):
    """At the cap a write is refused with RESOURCE_EXHAUSTED and a retry time; the oldest
    entries are never dropped. Once the consumers catch up (acknowledged, trimmed) the
    writer's retry lands and is announced."""
    feed = Feed(store, ready_maxlen=3)
    try:
        samples = [feed.write(rng, sid()).sample_id for _ in range(3)]
        late = synthetic_record(sid(), SMALL, 8, rng)
        with pytest.raises(ResourceExhausted) as refused:
            feed.client.write(late)
        assert "cap" in str(refused.value) and refused.value.retry_after_s > 0
        assert _entries(feed) == samples
        consumer = feed.consumer("t")
        assert len(consumer.settle(consumer.next_groups(3, timeout_s=2))) == 3
        feed.server.feed.keep_acked_ms = 0
        feed.server.feed.trim()
        feed.client.write(late)
        assert _entries(feed) == [late.sample_id]
        (group,) = consumer.next_groups(1, timeout_s=2)
        assert group.sample_ids == [late.sample_id]
    finally:
        feed.close()


@pytest.fixture
def small_redis():
    """A Redis of its own with 4 MiB of maxmemory, as deployed: noeviction."""
    node = RedisProcess("--maxmemory", "4mb", "--maxmemory-policy", "noeviction").start()
    yield node
    node.stop()


def test_writes_are_refused_whole_at_the_memory_budget(small_redis, rng, sid):
    """Writes of 64 KiB records land until Redis holds half its maxmemory; the next is
    refused with RESOURCE_EXHAUSTED and a retry time, before any of it is stored, and counted.
    The trainer commits (its group acknowledges: the records are freed), and writes land
    again."""
    from route_cache.connection import connect
    from route_cache.store import RouteStore

    store = RouteStore(connect(small_redis.url, cluster=False), ttl_ms=600_000)
    feed = Feed(store, memory_budget=0.5, commit_groups="trainer", free_grace_s=0)
    try:
        feed.server.budget.read()
        written, refused = [], None
        for _ in range(100):
            record = synthetic_record(sid(), SMALL, 3000, rng)
            try:
                feed.client.write(record)
            except ResourceExhausted as exc:
                refused = (record, exc)
                break
            written.append(record.sample_id)
            feed.server.budget.read()  # the upkeep thread's next reading, now
        assert refused is not None and len(written) > 3
        record, exc = refused
        assert "memory budget" in str(exc) and exc.retry_after_s >= 1
        with pytest.raises(NotFound):
            feed.client.stat(record.sample_id)
        assert feed.server.budget.refused == 1
        info = feed.redis.info("memory")
        assert info["used_memory"] < info["maxmemory"]  # refused before Redis was full
        consumer = feed.consumer("trainer", max_entries=100)
        assert len(consumer.settle(consumer.next_groups(len(written), timeout_s=5))) == len(written)
        feed.server.budget.read()
        feed.client.write(record)
        assert feed.client.stat(record.sample_id).sample_id == record.sample_id
    finally:
        feed.close()
        store.client.close()


def test_acknowledgements_free_records_at_redis_own_memory_limit(small_redis, rng, sid):
    """No budget: writes fill Redis to its maxmemory and it refuses them itself. The trainer's
    acknowledgements (a claim script that writes) still run, and free what it committed."""
    from route_cache.connection import connect
    from route_cache.store import RouteStore

    store = RouteStore(connect(small_redis.url, cluster=False), ttl_ms=600_000)
    feed = Feed(store, memory_budget=0, commit_groups="trainer", free_grace_s=0)
    try:
        feed.client.read_ready("trainer", "trainer")  # the group, made before the run
        written = []
        with pytest.raises(ResourceExhausted, match="maxmemory") as refused:
            for _ in range(200):
                record = synthetic_record(sid(), SMALL, 3000, rng)
                feed.client.write(record)
                written.append(record.sample_id)
        assert refused.value.retry_after_s and len(written) > 3
        consumer = feed.consumer("trainer", max_entries=200)
        settled = consumer.settle(consumer.next_groups(len(written), timeout_s=5))
        assert len(settled) == len(written) and feed.server.feed.freed == len(written)
        feed.client.write(synthetic_record(sid(), SMALL, 3000, rng))
    finally:
        feed.close()
        store.client.close()


def test_a_freed_record_is_deleted_when_its_grace_ends(rng, sid):
    """Redis finds expired keys by sampling those with a time to live; among 20,000 others
    (the claims' hour, in a long run) a freed record would linger, holding its memory. The
    route cache deletes what it freed once the grace is over (DBSIZE counts keys that are
    still in memory, expired or not)."""
    from route_cache.connection import connect
    from route_cache.store import RouteStore

    node = RedisProcess().start()
    store = RouteStore(connect(node.url, cluster=False), ttl_ms=600_000)
    pipe = store.client.pipeline(transaction=False)
    for i in range(20_000):
        pipe.set(f"other-{i}", b"x", ex=3600)
    pipe.execute()
    feed = Feed(store, memory_budget=0, commit_groups="trainer", free_grace_s=0.3)
    try:
        feed.write(rng, sid())
        consumer = feed.consumer("trainer")
        before = store.client.dbsize()
        assert len(consumer.settle(consumer.next_groups(1, timeout_s=2))) == 1
        time.sleep(1.0)
        assert store.client.dbsize() == before + 1 - 2  # + its claims, - its hash and routes
    finally:
        feed.close()
        store.client.close()
        node.stop()


def test_a_read_can_start_a_short_expiry_for_what_it_fetched(store, rng, sid):
    """verl's trainer has no ready feed to acknowledge: its reads ask that what they fetched
    expire within a time. The expiry only ever shortens; unknown ids are fine."""
    feed = Feed(store)
    try:
        fetched, other = feed.write(rng, sid()), feed.write(rng, sid())
        keys = (record_key(fetched.sample_id), routes_key(fetched.sample_id))
        ids = [fetched.sample_id, sid()]
        got = list(feed.client.read_batch(ids, skip_missing=True, expire_after_s=30))
        assert got[0].sample_id == fetched.sample_id
        assert all(0 < feed.redis.pttl(k) <= 30_000 for k in keys)
        assert feed.redis.pttl(record_key(other.sample_id)) > 60_000
        list(feed.client.read_batch(ids, skip_missing=True, expire_after_s=3600))
        assert all(0 < feed.redis.pttl(k) <= 30_000 for k in keys)  # not lengthened
    finally:
        feed.close()


def test_the_budget_holds_each_cluster_node_to_its_own(rng, sid):
    """A Redis Cluster of 3 masters with 4 MiB each: writes to records on one node are refused
    once that node is at its budget, while records on the others still land."""
    from redis.crc import key_slot

    from route_cache.connection import connect
    from route_cache.store import RouteStore
    from routereplay.dev.redis_nodes import start_cluster

    nodes = start_cluster(
        3,
        lambda: RedisProcess(
            "--maxmemory", "4mb", "--maxmemory-policy", "noeviction", cluster=True
        ),
    )
    client = connect(nodes[0].url.rsplit("/", 1)[0], cluster=True)
    feed = Feed(RouteStore(client, ttl_ms=600_000), memory_budget=0.5)

    def on(node: int) -> str:  # a sample id whose record lives on ``node``
        while True:
            sample_id = sid()
            slot = key_slot(record_key(sample_id).encode())
            found = next(i for i in range(3) if i * 16384 // 3 <= slot < (i + 1) * 16384 // 3)
            if found == node:
                return sample_id

    try:
        feed.server.budget.read()
        with pytest.raises(ResourceExhausted, match="memory budget") as refused:
            for _ in range(100):
                feed.client.write(synthetic_record(on(0), SMALL, 3000, rng))
                feed.server.budget.read()
        assert f":{nodes[0].port}" in str(refused.value)
        for node in (1, 2):
            feed.client.write(synthetic_record(on(node), SMALL, 3000, rng))
    finally:
        feed.close()
        client.close()
        for node in nodes:
            node.stop()


def test_the_claim_shares_the_streams_slot_and_frees_only_what_every_group_committed(
    store, rng, sid
):
    """Issue 47: a sample's claims live in the ready stream's slot, so one script claims and
    acknowledges (a failover keeps both or loses both), and the record, on its own slot, is
    freed in a second step: from the freeing set, which only the claim of the last commit
    group fills. Here the acknowledging process dies between the two steps (its ``free``
    never runs: the freeing is left to the route cache's ``Upkeep``, called by hand), and then
    the records' shard fails at the second step: the acknowledgement, done, still counts."""
    feed = Feed(store, commit_groups="a,b", free_grace_s=30)
    feed.server.upkeep.stop()  # its free() is called by hand below
    try:
        record = feed.write(rng, sid())
        stream_slot = key_slot(feed.stream.encode())
        assert key_slot(settled_key(feed.stream, record.sample_id).encode()) == stream_slot
        assert key_slot(freeing_key(feed.stream).encode()) == stream_slot
        dying = ReadyFeed(feed.redis, feed.stream, commit_groups=("a", "b"), free_grace_ms=30_000)
        dying.free = lambda samples=None: 0  # dies before freeing what it committed
        failing = ReadyFeed(feed.redis, feed.stream, commit_groups=("a", "b"))

        def unreachable(samples=None):
            raise Unavailable("the records' shard is down (stands in for a failed PEXPIRE)")

        failing.free = unreachable
        upkeep = ReadyFeed(feed.redis, feed.stream, commit_groups=("a", "b"), free_grace_ms=30_000)
        keys = (record_key(record.sample_id), routes_key(record.sample_id))
        for group, freed, acker in (("a", 0, dying), ("b", 1, failing)):
            (entry,) = feed.client.read_ready(group, f"{group}0", max_entries=1).entries
            assert acker.ack(group, [entry.entry_id], f"{group}0", [record.sample_id]) == 1
            assert all(feed.redis.pttl(k) > 60_000 for k in keys), group  # not freed yet
            assert upkeep.free() == freed, group  # only once every commit group claimed it
        assert all(0 < feed.redis.pttl(k) <= 30_000 for k in keys)
        assert feed.redis.scard(freeing_key(feed.stream)) == 0
        assert upkeep.free() == 0  # emptied: a repeat finds nothing
    finally:
        feed.close()
