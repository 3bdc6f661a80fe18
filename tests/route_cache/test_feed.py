"""The ready feed over real gRPC, on a real single node and a real cluster: announcements on
commit, consumer groups, redelivery of what was not acknowledged, whole GRPO groups."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid

import pytest

from route_cache.config import Config, parse_config
from route_cache.connection import connect
from route_cache.record_format import dead_letter_key, settled_key
from route_cache.server import RouteCacheServer
from route_cache.store import RouteStore
from routereplay.dev.synthetic import synthetic_record
from routereplay.domain.record import Turn, TurnAppend
from routereplay.errors import AlreadyExists, FailedPrecondition, InvalidArgument
from routereplay.rpc.client import AsyncRouteCacheClient, RouteCacheClient
from routereplay.rpc.ready import ReadyConsumer
from tests.route_cache.conftest import SMALL


class Feed:
    """A route cache server with its own ready stream, and what tests need around it."""

    def __init__(self, store: RouteStore, **overrides):
        self.stream = f"rr:ready:{uuid.uuid4().hex[:8]}"
        settings = dict(
            host="127.0.0.1",
            port=0,
            grace_s=1,
            health_interval_s=0.1,
            ready_stream=self.stream,
            ready_max_block_ms=5000,
            max_batch=300,
        )
        self.redis = store.client
        self.server = RouteCacheServer(Config(**{**settings, **overrides}), store).start()
        self.target = f"127.0.0.1:{self.server.port}"
        self._clients: list[RouteCacheClient] = []
        self.client = self.connect()

    def connect(self) -> RouteCacheClient:
        client = RouteCacheClient(self.target, timeout_s=10)
        self._clients.append(client)
        return client

    def consumer(self, name: str, group_size: int = 1, group: str = "trainer", **kwargs):
        """A ReadyConsumer on a client of its own (a new client: a restarted process)."""
        kwargs.setdefault("block_ms", 200)
        kwargs.setdefault("max_entries", 16)
        return ReadyConsumer(self.connect(), group, name, group_size, **kwargs)

    def write(self, rng, sample_id: str, group_id: str = "", policy_version: int = 0):
        record = synthetic_record(
            sample_id, SMALL, 8, rng, group_id=group_id, policy_version=policy_version
        )
        self.client.write(record)
        return record

    def pending(self, group: str = "trainer") -> int:
        return self.redis.xpending(self.stream, group)["pending"]

    def close(self):
        for client in self._clients:
            client.close()
        self.server.stop(0)


@pytest.fixture
def feed(store):
    feed = Feed(store)
    yield feed
    feed.close()


@pytest.fixture
def single_store(redis_node):
    client = connect(redis_node.url, cluster=False)
    yield RouteStore(client, ttl_ms=600_000)
    client.close()


def ids(groups) -> list[list[str]]:
    return [sorted(g.sample_ids) for g in groups]


def incomplete(consumer: ReadyConsumer) -> list:
    """The consumer's groups still waiting for samples (a rollout that never finished leaves
    one)."""
    return [g for g in consumer._groups.values() if len(g.entries) < consumer._size(g.key)]


def test_commit_announces_the_record(feed, rng, sid):
    record = feed.write(rng, sid(), group_id="g-1", policy_version=3)
    page = feed.client.read_ready("trainer", "rank0", max_entries=10)
    assert [(e.sample_id, e.group_id, e.num_tokens, e.policy_versions) for e in page.entries] == [
        (record.sample_id, "g-1", 8, (3,))
    ]
    assert (page.pending_cursor, page.trimmed) == ("", 0)
    # A retried write (duplicate) announces it again: the first announcement may have been lost.
    assert feed.client.write(record).duplicate is True
    assert feed.redis.xlen(feed.stream) == 2
    assert feed.client.ack_ready("trainer", [page.entries[0].entry_id]) == 1
    assert feed.client.ack_ready("trainer", [page.entries[0].entry_id]) == 0  # idempotent


def test_a_refused_write_announces_nothing(feed, rng, sid):
    """On a single Redis the commit script adds the entry (on a cluster, the server after
    the commit): a write refused as a conflict leaves the stream as it was."""
    record = feed.write(rng, sid())
    other = synthetic_record(record.sample_id, SMALL, 12, rng)
    with pytest.raises(AlreadyExists):
        feed.client.write(other)
    entries = feed.redis.xrange(feed.stream)
    assert [fields[b"sample_id"].decode() for _, fields in entries] == [record.sample_id]
    assert entries[0][1][b"num_tokens"] == b"8"


def test_a_multi_turn_sample_is_announced_when_complete(feed, rng, sid):
    """``more_turns`` on the write holds the announcement back; the append marked ``final``
    announces the whole record (its token count, every turn's version); other appends don't."""
    whole = synthetic_record(sid(), SMALL, 40, rng, prompt_tokens=10, group_id="g-mt")
    lp = whole.turns[0].logprobs
    first = type(whole)(
        whole.sample_id,
        SMALL,
        whole.token_ids[:25],
        whole.routes[:24],
        [Turn(0, 25, 10, 3, lp[:15])],
        "g-mt",
    )
    feed.client.write(first, more_turns=True)
    second = TurnAppend(
        whole.sample_id,
        SMALL,
        24,
        whole.token_ids[25:30],
        whole.routes[24:29],
        [Turn(25, 30, 27, 4, lp[5:8])],
    )
    feed.client.append(second)
    assert feed.redis.xlen(feed.stream) == 0
    last = TurnAppend(
        whole.sample_id,
        SMALL,
        29,
        whole.token_ids[30:],
        whole.routes[29:],
        [Turn(30, 40, 32, 5, lp[7:15])],
    )
    feed.client.append(last, final=True)
    page = feed.client.read_ready("trainer", "rank0", max_entries=10)
    assert [(e.sample_id, e.group_id, e.num_tokens, e.policy_versions) for e in page.entries] == [
        (whole.sample_id, "g-mt", 40, (3, 4, 5))
    ]


def test_duplicate_write_yields_the_sample_once(feed, rng, sid):
    record = feed.write(rng, sid())
    feed.client.write(record)
    consumer = feed.consumer("rank0")
    (group,) = consumer.next_groups(2, timeout_s=0.3)
    assert group.sample_ids == [record.sample_id] and len(group.entry_ids) == 2
    assert consumer.duplicates == 1
    assert consumer.settle([group]) == [group] and feed.pending() == 0
    # A late repeat of a trained sample is acknowledged at once, never handed out.
    feed.client.write(record)
    assert consumer.next_groups(1, timeout_s=0.3) == []
    assert consumer.duplicates == 2 and feed.pending() == 0


def test_two_consumers_of_one_group_split_the_entries(feed, rng, sid):
    written = {feed.write(rng, sid()).sample_id for _ in range(6)}
    first = feed.client.read_ready("trainer", "rank0", max_entries=3)
    second = feed.client.read_ready("trainer", "rank1", max_entries=10)
    a = {e.sample_id for e in first.entries}
    b = {e.sample_id for e in second.entries}
    assert len(a) == 3 and len(b) == 3 and a | b == written
    # Another consumer group gets every entry again.
    other = feed.client.read_ready("evaluator", "e0", max_entries=10)
    assert {e.sample_id for e in other.entries} == written


def test_restarted_consumer_gets_back_what_it_had_not_acknowledged(feed, rng, sid):
    for group_id in ("g-a", "g-b"):
        for _ in range(2):
            feed.write(rng, sid(), group_id=group_id)
    consumer = feed.consumer("rank0", group_size=2, max_entries=1)
    trained, crashed = consumer.next_groups(2, timeout_s=2)
    assert consumer.settle([trained]) == [trained]
    # The process dies before acknowledging the second group; it restarts under its name.
    consumer.client.close()
    restarted = feed.consumer("rank0", group_size=2, max_entries=1)
    (again,) = restarted.next_groups(2, timeout_s=0.5)
    assert (again.group_id, sorted(again.sample_ids)) == (
        crashed.group_id,
        sorted(crashed.sample_ids),
    )
    assert restarted.settle([again]) == [again]
    assert feed.pending() == 0
    assert feed.consumer("rank0", group_size=2).next_groups(1, timeout_s=0.3) == []


def test_groups_come_out_whole(feed, rng, sid):
    a = [feed.write(rng, sid(), group_id="g-a").sample_id for _ in range(2)]
    b = [feed.write(rng, sid(), group_id="g-b").sample_id for _ in range(3)]
    loose = feed.write(rng, sid()).sample_id  # no group id: a group of its own
    consumer = feed.consumer("rank0", group_size=3)
    groups = consumer.next_groups(3, timeout_s=0.5)
    assert ids(groups) == [sorted(b), [loose]]
    assert ids(incomplete(consumer)) == [sorted(a)]
    a.append(feed.write(rng, sid(), group_id="g-a").sample_id)
    (group,) = consumer.next_groups(1, timeout_s=2)
    assert sorted(group.sample_ids) == sorted(a)
    assert consumer.settle([*groups, group]) == [*groups, group]
    # A sample beyond a group's size is dropped (and acknowledged), not a new group.
    feed.write(rng, sid(), group_id="g-a")
    assert consumer.next_groups(1, timeout_s=0.3) == []
    assert consumer.extra == 1 and feed.pending() == 0


def test_a_stand_by_claims_the_entries_of_a_dead_consumer(feed, rng, sid):
    written = {feed.write(rng, sid()).sample_id for _ in range(3)}
    assert len(feed.client.read_ready("trainer", "dead", max_entries=10).entries) == 3
    stand_by = feed.consumer("stand-by", claim_idle_ms=400, max_entries=2)
    assert stand_by.next_groups(3, timeout_s=0.05) == []  # not idle long enough yet
    time.sleep(0.45)
    groups = stand_by.next_groups(3, timeout_s=2)
    assert {s for g in groups for s in g.sample_ids} == written
    assert stand_by.settle(groups) == groups
    assert feed.pending() == 0


def test_a_stalled_consumer_does_not_settle_what_another_claimed(feed, rng, sid):
    """Found by the fault run: a consumer SIGSTOPped past the claim time-out, its read's
    answer already sent, trained the sample after the other consumer had claimed, trained and
    acknowledged it. ``settle`` tells each which groups it may commit: exactly one of them."""
    sample_id = feed.write(rng, sid()).sample_id
    stalled = feed.consumer("c0", claim_idle_ms=300)
    (held,) = stalled.next_groups(1, timeout_s=1)  # then it stalls, holding the sample
    time.sleep(0.35)
    other = feed.consumer("c1", claim_idle_ms=300)
    (claimed,) = other.next_groups(1, timeout_s=1)
    assert claimed.sample_ids == held.sample_ids == [sample_id]
    assert other.settle([claimed]) == [claimed]  # the first to acknowledge commits
    assert stalled.settle([held]) == [] and stalled.taken == 1  # the stalled one must not
    assert feed.pending() == 0
    # The order can go the other way: the stalled one resumes first and wins.
    sample_id = feed.write(rng, sid()).sample_id
    (held,) = stalled.next_groups(1, timeout_s=1)
    time.sleep(0.35)
    (claimed,) = other.next_groups(1, timeout_s=1)
    assert stalled.settle([held]) == [held] and other.settle([claimed]) == []


def test_a_sample_announced_twice_is_settled_by_one_consumer_only(feed, rng, sid):
    """A retried write announces its sample again. With two consumers in a group, the two
    entries can reach different consumers: both train it, and ``settle`` lets only the first
    to acknowledge commit (the fence is by sample, not by entry). Deleted and written again,
    the sample is announced and settled anew."""
    record = feed.write(rng, sid())
    assert feed.client.write(record).duplicate  # the retry: announced a second time
    first, second = feed.consumer("c0", max_entries=1), feed.consumer("c1", max_entries=1)
    (held,) = first.next_groups(1, timeout_s=1)
    (other,) = second.next_groups(1, timeout_s=1)
    assert held.sample_ids == other.sample_ids == [record.sample_id]
    assert held.entry_ids != other.entry_ids
    assert second.settle([other]) == [other]
    assert first.settle([held]) == [] and first.taken == 1
    assert feed.pending() == 0
    feed.client.delete(record.sample_id)
    feed.client.write(record)
    third = feed.consumer("c2")
    (again,) = third.next_groups(1, timeout_s=1)
    assert third.settle([again]) == [again]


def test_a_retried_settle_whose_first_answer_was_lost_still_settles(feed, rng, sid):
    """Found by the fault run: a consumer SIGSTOPped with its acknowledgement in flight; the
    route cache applied it, the call ran past its deadline, and the retry found nothing
    pending: the group was dropped as taken, and nobody trained the sample. The claim names
    the consumer, so its own retry counts; another consumer's acknowledgement still does not."""
    record = feed.write(rng, sid())
    consumer = feed.consumer("c0")
    (group,) = consumer.next_groups(1, timeout_s=1)
    # The first attempt, applied by the route cache; its answer never reached the consumer.
    assert feed.client.ack_ready("trainer", group.entry_ids, "c0") == 1
    assert consumer.settle([group]) == [group] and consumer.taken == 0
    assert feed.client.ack_ready("trainer", group.entry_ids, "c1") == 0
    assert feed.client.ack_ready("trainer", group.entry_ids) == 0  # unnamed: XACK alone
    assert group.sample_ids == [record.sample_id]


def test_a_claim_by_an_entry_the_stream_lost_passes_to_the_next_announcement(feed, rng, sid):
    """Found by the fault run's WAIT-only fault on the feed's shard (issue 29): c0 read an
    announcement while the stream master's replica was cut off, and its acknowledgement
    claimed the sample (then on the sample's own shard) before the master died with the entry.
    Since issue 47 the claim shares the stream's slot, and a replica holds a prefix of its
    master's writes, so a failover that loses the entry loses its claim too: the state below
    is kept as a guard of the handover rule.
    The writer's retry announced the sample again and c1 trained it, but the claim named the
    lost entry: c1 was told taken, c0's retry found its entry gone, and nobody trained the
    sample. Here XACK and XDEL stand in for the failover (the same state: the tail entry and
    its pending record gone, the earlier entries and the claim kept)."""
    feed.write(rng, sid())  # an earlier entry, replicated before the cut
    c0, c1 = feed.consumer("c0"), feed.consumer("c1")
    c0.next_groups(1, timeout_s=1)
    record = feed.write(rng, sid())
    (lost,) = c0.next_groups(1, timeout_s=1)
    # c0's first acknowledgement: the claim landed, the master died before its XACK.
    feed.redis.hsetnx(
        settled_key(feed.stream, record.sample_id), "trainer", f"{lost.entry_ids[0]} c0"
    )
    feed.redis.xack(feed.stream, "trainer", *lost.entry_ids)  # nor its pending record
    feed.redis.xdel(feed.stream, *lost.entry_ids)
    feed.client.write(record)  # the writer's retry announces the sample again
    (again,) = c1.next_groups(1, timeout_s=1)
    assert again.sample_ids == lost.sample_ids and again.entry_ids != lost.entry_ids
    assert c0.settle([lost]) == [] and c0.taken == 1
    assert c1.settle([again]) == [again] and c1.taken == 0
    assert c0.settle([lost]) == []  # the lost entry's retry does not take it back


def test_an_entry_delivered_again_after_a_failover_is_settled_by_the_first_claim(feed, rng, sid):
    """Found by the full fault run (issue 29): c1 read an entry, and its acknowledgement
    claimed the sample, but the stream's master died before the XACK (and the delivery)
    reached its replica. The promoted replica delivered the entry again, to c0, whose XACK
    then counted: c0 was told settled, and so was c1's retry (its own claim). Both trained it.
    XCLAIM stands in for the new delivery; the claim is kept (then on the sample's own shard;
    since issue 47 claim and XACK are one script, so this state is a guard of the rule)."""
    record = feed.write(rng, sid())
    c0, c1 = feed.consumer("c0"), feed.consumer("c1")
    (first,) = c1.next_groups(1, timeout_s=1)
    # c1's first acknowledgement: the claim landed; the XACK went down with the master.
    feed.redis.hsetnx(
        settled_key(feed.stream, record.sample_id), "trainer", f"{first.entry_ids[0]} c1"
    )
    feed.redis.xclaim(feed.stream, "trainer", "c0", 0, first.entry_ids)
    c0._pending_cursor = "0"  # read its pending entries again, as a fresh read would
    (again,) = c0.next_groups(1, timeout_s=1)
    assert again.entry_ids == first.entry_ids
    assert c0.settle([again]) == [] and c0.taken == 1
    assert c1.settle([first]) == [first]  # c1's retry: its own claim


def test_a_sample_read_from_a_lost_entry_and_its_repeat_is_settled(feed, rng, sid):
    """Found by the short fault run (a Redis Cluster, the WAIT-only fault on the stream's
    shard): c1 read a sample's announcement from the stream's old master, then, in the same
    batch, the writer's retried announcement from the promoted replica, which never had the
    first. Its settle acknowledged both: the lost entry counted nothing, the group came out
    short (1 of 2) and was dropped as taken, while the repeat's acknowledgement had claimed
    the sample for c1; no announcement followed, and nobody trained it. The consumer names
    each entry's sample, so an entry the stream lost counts as its sample's other entries in
    the call do. XACK and XDEL stand in for the failover."""
    feed.write(rng, sid())  # an earlier entry, replicated before the cut
    consumer = feed.consumer("c1")
    assert consumer.settle(consumer.next_groups(1, timeout_s=1))
    record = feed.write(rng, sid())
    consumer.poll(block_ms=200)  # read from the old master, group complete, not handed out
    ((lost, _),) = feed.redis.xrevrange(feed.stream, count=1)
    feed.redis.xack(feed.stream, "trainer", lost)
    feed.redis.xdel(feed.stream, lost)
    feed.client.write(record)  # the writer's retry, announced on the promoted replica
    consumer.poll(block_ms=200)
    (group,) = consumer.next_groups(1, timeout_s=1)
    assert group.sample_ids == [record.sample_id] and len(group.entry_ids) == 2
    assert consumer.settle([group]) == [group] and consumer.taken == 0
    other = feed.consumer("c0", claim_idle_ms=1)
    assert other.next_groups(1, timeout_s=0.3) == []  # nothing left for anyone to train


def test_a_claim_by_a_trimmed_entry_holds(feed, rng, sid):
    """A late repeat of a sample whose claiming entry was trimmed (acknowledged long ago, the
    oldest in the stream) is not trained again: only an entry newer than the stream's first
    one can have been lost."""
    record = feed.write(rng, sid())
    consumer = feed.consumer("c0")
    (group,) = consumer.next_groups(1, timeout_s=1)
    assert consumer.settle([group]) == [group]
    feed.redis.xtrim(feed.stream, maxlen=0, approximate=False)
    feed.write(rng, sid())
    feed.client.write(record)  # a late repeat
    other = feed.consumer("c1", max_entries=2)
    late = [g for g in other.next_groups(2, timeout_s=1) if g.sample_ids == group.sample_ids]
    assert other.settle(late) == [] and other.taken == 1


def test_a_repeat_settled_with_its_group_counts(feed, rng, sid):
    """A consumer that reads both announcements of a sample files the repeat with the group
    and acknowledges both entries together: the group is settled."""
    record = feed.write(rng, sid())
    feed.client.write(record)
    consumer = feed.consumer("c0")
    consumer.poll(block_ms=200)
    (group,) = consumer.next_groups(1, timeout_s=1)
    assert len(group.entry_ids) == 2 and consumer.duplicates == 1
    assert consumer.settle([group]) == [group]


def test_trimmed_pending_entries_are_counted_and_dropped(feed, rng, sid):
    for _ in range(2):
        feed.write(rng, sid())
    assert len(feed.client.read_ready("trainer", "rank0", max_entries=10).entries) == 2
    feed.redis.xtrim(feed.stream, maxlen=0, approximate=False)
    restarted = feed.consumer("rank0")
    assert restarted.next_groups(1, timeout_s=0.3) == []
    assert restarted.trimmed == 2 and feed.pending() == 0


def test_a_waiting_read_wakes_on_a_commit(feed, rng, sid):
    feed.client.read_ready("trainer", "rank0", max_entries=1)  # creates the group
    result = {}

    def wait():
        start = time.monotonic()
        result["page"] = feed.client.read_ready("trainer", "rank0", block_ms=4000)
        result["waited"] = time.monotonic() - start

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.3)
    record = feed.write(rng, sid())
    waiter.join(5)
    assert [e.sample_id for e in result["page"].entries] == [record.sample_id]
    assert 0.2 < result["waited"] < 3


def test_start_from_latest_skips_older_entries(feed, rng, sid):
    feed.write(rng, sid())
    consumer = feed.consumer("rank0", group="new-run", start_from_latest=True)
    assert consumer.next_groups(1, timeout_s=0.2) == []
    record = feed.write(rng, sid())
    assert ids(consumer.next_groups(1, timeout_s=2)) == [[record.sample_id]]


def test_a_sample_settled_untrained_goes_to_the_dead_letter_stream_once(feed, rng, sid):
    """Issue 47: a consumer whose sample's record was lost settles it as a dead letter: the
    entry is acknowledged with its group like the rest, and the sample is added, once per
    consumer group, to the dead-letter stream in the ready stream's slot, with the reason,
    and counted on /metrics."""
    lost, kept = feed.write(rng, sid(), group_id="g"), feed.write(rng, sid(), group_id="g")
    consumer = feed.consumer("c0", group_size=2)
    (group,) = consumer.next_groups(1, timeout_s=2)
    assert consumer.settle([group], [lost.sample_id], "record missing") == [group]
    assert feed.pending() == 0
    dead = feed.redis.xrange(dead_letter_key(feed.stream))
    assert [{k.decode(): v.decode() for k, v in f.items()} for _, f in dead] == [
        {
            "sample_id": lost.sample_id,
            "consumer_group": "trainer",
            "consumer": "c0",
            "entry_id": group.entry_ids[group.sample_ids.index(lost.sample_id)],
            "reason": "record missing",
        }
    ]
    # A retry whose first answer was lost settles again, and adds nothing.
    entries, samples = group.entry_ids, list(group.delivered.values())
    assert feed.client.ack_ready("trainer", entries, "c0", samples, [lost.sample_id], "x") == 2
    assert feed.redis.xlen(dead_letter_key(feed.stream)) == 1
    assert feed.server.feed.dead_lettered == 1
    assert kept.sample_id not in {f[b"sample_id"].decode() for _, f in dead}
    registry = feed.server.metrics.registry  # what /metrics serves (test_metrics scrapes it)
    assert registry.get_sample_value("route_cache_ready_dead_letters_total") == 1


def test_async_client(single_store, rng, sid):
    feed = Feed(single_store)
    try:
        record = feed.write(rng, sid())

        async def run():
            async with AsyncRouteCacheClient(feed.target, timeout_s=10) as client:
                page = await client.read_ready("trainer", "rank0", max_entries=5, block_ms=100)
                acked = await client.ack_ready("trainer", [e.entry_id for e in page.entries])
                return page, acked

        page, acked = asyncio.run(run())
        assert [e.sample_id for e in page.entries] == [record.sample_id] and acked == 1
    finally:
        feed.close()


@pytest.mark.parametrize(
    "call, field",
    [
        (lambda c: c.read_ready("", "rank0"), "consumer_group is empty"),
        (lambda c: c.read_ready("trainer", "rank 0"), "consumer 'rank 0'"),
        (lambda c: c.read_ready("trainer", "r" * 257), "consumer is 257 characters"),
        (lambda c: c.read_ready("trainer", "rank0", max_entries=0), "max_entries is 0"),
        (lambda c: c.read_ready("trainer", "rank0", max_entries=301), "max_entries is 301"),
        (lambda c: c.read_ready("trainer", "rank0", block_ms=5001), "block_ms is 5001"),
        (lambda c: c.read_ready("trainer", "rank0", pending_cursor="abc"), "pending_cursor"),
        (lambda c: c.read_ready("trainer", "rank0", claim_cursor="1-x"), "claim_cursor"),
        (lambda c: c.ack_ready("trainer", []), "entry_ids is empty"),
        (lambda c: c.ack_ready("trainer", ["1-0", "nope"]), "entry_ids[1]"),
        (lambda c: c.ack_ready("trainer", ["1-0"] * 301), "entry_ids has 301 ids"),
        (
            lambda c: c.ack_ready("trainer", ["1-0"], "c", ["s1"], ["s2"], "lost"),
            "dead_letter_ids ['s2'] are not in sample_ids",
        ),
        (
            lambda c: c.ack_ready("trainer", ["1-0"], "c", ["s1"], ["s1"]),
            "dead_letter_reason must be",
        ),
        # Past unsigned 64 bits: Redis would refuse it (found by fuzzing: it was INTERNAL).
        (lambda c: c.ack_ready("trainer", ["99999999999999999999"]), "entry_ids[0]"),
        (
            lambda c: c.read_ready("trainer", "r", pending_cursor="1-99999999999999999999"),
            "pending_cursor",
        ),
        (lambda c: c.ack_ready("{x}", ["1-0"]), "consumer_group '{x}'"),
        (lambda c: c.ack_ready("trainer", ["1-0", "2-0"], "c", ["s"]), "1 ids for 2 entry_ids"),
        (lambda c: c.ack_ready("trainer", ["1-0"], "c", ["s s"]), "sample_ids[0]"),
    ],
)
def test_bad_input(single_store, call, field):
    feed = Feed(single_store)
    try:
        with pytest.raises(InvalidArgument, match=field.replace("[", r"\[")):
            call(feed.client)
    finally:
        feed.close()


def test_feed_disabled(single_store, rng, sid):
    feed = Feed(single_store, ready_stream="")
    try:
        feed.write(rng, sid())  # records are stored as before, just not announced
        for call in (
            lambda: feed.client.read_ready("trainer", "rank0"),
            lambda: feed.client.ack_ready("trainer", ["1-0"]),
        ):
            with pytest.raises(FailedPrecondition, match="ready feed is disabled"):
                call()
        assert feed.redis.exists(feed.stream) == 0
    finally:
        feed.close()


def test_configuration():
    assert parse_config([], env={}).ready_stream == "rr:ready"
    assert parse_config([], env={"ROUTE_CACHE_READY_STREAM": ""}).ready_stream == ""
    assert parse_config(["--ready-maxlen", "10"], env={}).ready_maxlen == 10
    with pytest.raises(SystemExit):
        parse_config(["--ready-max-block-ms", "60000"], env={})
