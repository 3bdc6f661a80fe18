"""The ready feed, seen from a trainer: which finished samples, as whole GRPO groups, form its
next batch.

The route cache announces every committed record on a Redis Stream (see ``docs/route_cache.md``,
"Ready feed"). Delivery is at least once: a retried write announces its record again, and
entries not acknowledged come back to a restarted consumer. ``ReadyConsumer`` turns that into
"once per consumer process": it drops repeated sample ids, holds samples until their whole
group is there, and acknowledges a group only when the caller says it was trained, so a crash
before that leads to redelivery, never to loss.

Plain Python: no protobuf here (``routereplay.rpc.wire`` converts). The feed's request and
page types are the domain's (``routereplay.domain.feed``).
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict, deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from routereplay.domain.feed import ReadyEntry, ReadyPage

log = logging.getLogger(__name__)


class ReadyClient(Protocol):
    """What ``ReadyConsumer`` needs of a route cache client (``RouteCacheClient`` has it)."""

    def read_ready(
        self,
        consumer_group: str,
        consumer: str,
        max_entries: int = ...,
        block_ms: int = ...,
        pending_cursor: str = ...,
        claim_idle_ms: int = ...,
        claim_cursor: str = ...,
        start_from_latest: bool = ...,
    ) -> ReadyPage: ...

    def ack_ready(
        self,
        consumer_group: str,
        entry_ids: Sequence[str],
        consumer: str = ...,
        sample_ids: Sequence[str] = ...,
        dead_letter_ids: Sequence[str] = ...,
        dead_letter_reason: str = ...,
    ) -> int: ...


@dataclass
class ReadyGroup:
    """A GRPO group whose samples have all been announced.

    Attributes:
        group_id: the records' group id; empty for a sample without one (a group of one).
        entries: one per sample, in arrival order.
        delivered: every stream entry to acknowledge for it, repeated deliveries included,
            with its sample (entry id -> sample id, in arrival order).
    """

    group_id: str
    entries: list[ReadyEntry] = field(default_factory=list)
    delivered: dict[str, str] = field(default_factory=dict)

    @property
    def sample_ids(self) -> list[str]:
        return [e.sample_id for e in self.entries]

    @property
    def entry_ids(self) -> list[str]:
        return list(self.delivered)

    @property
    def key(self) -> tuple[str, str]:
        # A sample without a group id is its own group; the tag keeps the two name spaces apart.
        if self.group_id:
            return ("group", self.group_id)
        return ("sample", self.entries[0].sample_id)


def _key(entry: ReadyEntry) -> tuple[str, str]:
    return ("group", entry.group_id) if entry.group_id else ("sample", entry.sample_id)


class _Bounded:
    """An insertion-ordered set that forgets its oldest members past ``limit``."""

    def __init__(self, limit: int):
        self.limit = limit
        self._items: OrderedDict = OrderedDict()

    def add(self, item) -> None:
        self._items[item] = None
        self._items.move_to_end(item)
        while len(self._items) > self.limit:
            self._items.popitem(last=False)

    def __contains__(self, item) -> bool:
        return item in self._items


class ReadyConsumer:
    """One consumer of a consumer group on the ready feed, handing out whole GRPO groups.

    All of a group's entries must reach the same consumer for the group to complete: run one
    ``ReadyConsumer`` per consumer group (for example on trainer rank 0, which then tells every
    rank its share of the batch's sample ids), and more only as stand-bys that claim the
    entries of a dead one (``claim_idle_ms``).

    Args:
        client: a ``RouteCacheClient`` (or anything with ``read_ready`` and ``ack_ready``).
        consumer_group: the consumer group (one per job that needs every sample once).
        consumer: this consumer's name; a restarted process must reuse it to get back the
            entries it had not acknowledged.
        group_size: samples per GRPO group. Samples without a group id are groups of one.
        max_entries: entries per read.
        block_ms: how long a read waits for new entries.
        claim_idle_ms: 0, or take over entries other consumers left unacknowledged this long.
            It must exceed the longest a live consumer holds an entry (assembling its group,
            then training on it), or live consumers lose entries to each other (then both
            train on them: still at least once).
        start_from_latest: when this consumer creates the consumer group, skip the entries
            already in the stream (samples of an earlier run).
        remember: how many acknowledged sample ids and group ids are remembered to drop
            late repeats.
    """

    def __init__(
        self,
        client: ReadyClient,
        consumer_group: str,
        consumer: str,
        group_size: int,
        *,
        max_entries: int = 256,
        block_ms: int = 1000,
        claim_idle_ms: int = 0,
        start_from_latest: bool = False,
        remember: int = 1_000_000,
    ):
        if group_size < 1:
            raise ValueError(f"group_size must be at least 1, got {group_size}")
        self.client = client
        self.consumer_group = consumer_group
        self.consumer = consumer
        self.group_size = group_size
        self.max_entries = max_entries
        self.block_ms = block_ms
        self.claim_idle_ms = claim_idle_ms
        self.start_from_latest = start_from_latest
        self._pending_cursor = "0"  # a (re)started consumer first re-reads its pending entries
        self._claim_cursor = ""
        # Every group not yet acknowledged: assembling, complete, or handed out.
        self._groups: dict[tuple[str, str], ReadyGroup] = {}
        self._complete: deque[ReadyGroup] = deque()  # complete, not handed out yet
        self._acked_samples = _Bounded(remember)
        self._acked_groups = _Bounded(remember)
        self.duplicates = 0  # repeated deliveries dropped
        self.extra = 0  # samples beyond group_size, acknowledged and dropped
        self.trimmed = 0  # pending entries the server found trimmed
        self.taken = 0  # groups another consumer claimed and acknowledged first (``settle``)

    def poll(self, block_ms: int | None = None) -> int:
        """One read of the feed. Returns how many entries it brought (repeats included)."""
        try:
            page = self.client.read_ready(
                self.consumer_group,
                self.consumer,
                max_entries=self.max_entries,
                block_ms=self.block_ms if block_ms is None else block_ms,
                pending_cursor=self._pending_cursor,
                claim_idle_ms=self.claim_idle_ms,
                claim_cursor=self._claim_cursor,
                start_from_latest=self.start_from_latest,
            )
        except Exception:
            # A failed read may still have delivered entries: they wait in this consumer's
            # pending list, so re-read it next time.
            self._pending_cursor = "0"
            raise
        self._pending_cursor = page.pending_cursor
        self._claim_cursor = page.claim_cursor
        self.trimmed += page.trimmed
        stale = [(e.entry_id, e.sample_id) for e in page.entries if not self._accept(e)]
        if stale:
            self._ack_delivered(stale)
        return len(page.entries)

    def _accept(self, entry: ReadyEntry) -> bool:
        """File ``entry``; False when it is to be acknowledged now (nothing to train)."""
        key = _key(entry)
        if entry.sample_id in self._acked_samples:
            self.duplicates += 1
            return False
        group = self._groups.get(key)
        if group is None and key in self._acked_groups:
            self._extra(entry)
            return False
        if group is None:
            group = self._groups[key] = ReadyGroup(entry.group_id)
        if entry.entry_id in group.delivered:  # the same delivery again (pending re-read)
            return True
        group.delivered[entry.entry_id] = entry.sample_id  # acknowledged with its group
        size = self._size(key)
        if entry.sample_id in group.sample_ids:
            self.duplicates += 1
        elif len(group.entries) >= size:
            self._extra(entry)
        else:
            group.entries.append(entry)
            if len(group.entries) == size:
                self._complete.append(group)
        return True

    def _size(self, key: tuple[str, str]) -> int:
        return self.group_size if key[0] == "group" else 1

    def _extra(self, entry: ReadyEntry) -> None:
        self.extra += 1
        log.warning(
            "sample %r is beyond group %r's %d samples: dropped",
            entry.sample_id,
            entry.group_id,
            self.group_size,
        )

    def next_groups(self, count: int, timeout_s: float | None = None) -> list[ReadyGroup]:
        """Up to ``count`` complete groups, reading the feed until there are that many or
        ``timeout_s`` has passed (None: wait as long as it takes). Each group is handed out
        once per process; acknowledge it with ``settle`` after training on it."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(self._complete) < count:
            wait_ms = self.block_ms
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                wait_ms = min(wait_ms, int(left * 1000))
            # Pending and claimed entries come without waiting; only new ones are awaited.
            self.poll(block_ms=wait_ms)
        return [self._complete.popleft() for _ in range(min(count, len(self._complete)))]

    def settle(
        self,
        groups: Iterable[ReadyGroup],
        dead_letters: Collection[str] = (),
        reason: str = "",
    ) -> list[ReadyGroup]:
        """Acknowledge each of ``groups`` on its own (trained, or given up on), and return
        those this consumer settled: the groups whose every entry this acknowledgement settled
        (``AckReady``'s count). Commit the training of those only. Their entries are not
        delivered again, and later repeats of their samples are dropped. The one
        acknowledgement of the feed: the trainer (``trainer.data.source.FeedPlans``) and the
        fault run's consumer call it alike.

        A consumer that stalls past ``claim_idle_ms`` (a paused process, a long step) loses
        its entries to another consumer, which trains and acknowledges them too; so does one
        whose read was answered while it was paused. Acknowledging is atomic in Redis, so of
        two consumers holding the same entry only one sees it still pending: the other gets
        the group back here as not settled (counted in ``taken``), and must not commit it.
        The same holds for two entries of one sample (announced twice): the route cache
        counts only the first entry acknowledged of a sample. Each entry goes with its
        sample, so one a failover of the stream's master lost (read from the old master,
        with the writer's repeat read from the new one) counts as its sample's others do.
        One call per group: the count the server returns is per call.

        ``dead_letters``: samples of ``groups`` that trained nothing (``decide_missing``:
        their record was lost after the announcement); they settle with their group, and the
        route cache adds each to its dead-letter stream with ``reason``.
        """
        won = []
        dead = set(dead_letters)
        for group in groups:
            named = [s for s in group.sample_ids if s in dead]
            acknowledged = self._ack_delivered(list(group.delivered.items()), named, reason)
            if acknowledged == len(group.delivered):
                self._forget(group)
                won.append(group)
            else:
                # Not remembered as settled: the entry may have vanished in a failover of the
                # stream's master (nobody trained it), and a repeat of it must then be trained,
                # not acknowledged as stale (which would claim the sample for no training).
                # If another consumer did settle it, a repeat trained here is taken again.
                self._groups.pop(group.key, None)
                self.taken += 1
                log.warning(
                    "group %r was settled by another consumer: not committed here", group.key
                )
        return won

    def covered(
        self,
        entry_ids: Sequence[str],
        sample_ids: Iterable[str],
        group_keys: Iterable[tuple[str, str]],
        dead: Sequence[tuple[str, str]] = (),
        reason: str = "",
        chunk: int = 512,
    ) -> int:
        """Entries an earlier process of this consumer trained and a checkpoint covers
        (``trainer.data.feed_log``): acknowledge them, and drop later repeats of those
        samples and groups as if this process had acknowledged them. ``dead``: (entry id,
        sample id) of those entries whose sample trained nothing, settled first, to the
        dead-letter stream with ``reason``. Returns how many entries the server still had
        pending."""
        ids = list(entry_ids)
        acknowledged = 0
        for start in range(0, len(dead), chunk):
            entries, samples = zip(*dead[start : start + chunk], strict=True)
            acknowledged += self.client.ack_ready(
                self.consumer_group, entries, self.consumer, samples, samples, reason
            )
        for start in range(0, len(ids), chunk):
            acknowledged += self.client.ack_ready(
                self.consumer_group, ids[start : start + chunk], self.consumer
            )
        for key in group_keys:
            self._acked_groups.add(tuple(key))
        for sample_id in sample_ids:
            self._acked_samples.add(sample_id)
        return acknowledged

    def _ack_delivered(
        self, delivered: list[tuple[str, str]], dead_letters: Sequence[str] = (), reason: str = ""
    ) -> int:
        """Acknowledge (entry id, sample id) pairs in one call: naming each entry's sample
        lets one the stream lost since (a failover) count as its sample's others do."""
        entry_ids, sample_ids = zip(*delivered, strict=True)
        named = {"dead_letter_ids": dead_letters, "dead_letter_reason": reason}
        return self.client.ack_ready(
            self.consumer_group,
            entry_ids,
            self.consumer,
            sample_ids,
            **(named if dead_letters else {}),
        )

    def _forget(self, group: ReadyGroup) -> None:
        """``group`` is done with: later repeats of it and of its samples are dropped."""
        self._groups.pop(group.key, None)
        self._acked_groups.add(group.key)
        for sample_id in group.sample_ids:
            self._acked_samples.add(sample_id)
