"""The ready feed: committed records announced on a Redis Stream, read through consumer groups.

A ``WriteRecord`` that commits (a duplicate write too: the retry of a write whose announcement
may have been lost) adds one entry, and the writer is answered only after that, so with the
writer's retries every committed record is announced at least once.

The stream is one key (``--ready-stream``, default ``rr:ready``). On a single Redis the entry
is added by the record's own commit script (``announcement``: one round trip, and no record
committed unannounced). In Redis Cluster the stream lives in its own slot, not the record's,
so the announcement cannot join the commit: it is a second command after it (``publish``; an
append marked final is announced that way everywhere). A route cache that dies between the
two leaves the record committed but unannounced until the writer's retry (a duplicate write)
announces it.

Entries hold ``sample_id``, ``group_id``, ``num_tokens`` and ``policy_versions`` (the turns'
versions, comma-separated). The stream is trimmed by consumption (``trim``: what every consumer
group acknowledged), and ``maxlen`` is a hard cap that refuses announcements (and so writes)
rather than dropping entries a group has not read. Pending entries removed by hand before
their acknowledgement come back as ``trimmed`` counts.

The acknowledgement frees: once every group of ``commit_groups`` holds a claim on a sample, the
claim script brings its record's expiry down to ``free_grace_ms`` (docs/route_cache.md,
"Lifecycle").

With the route cache's ``--wait-replicas``, an announcement is answered only once that many
replicas hold it (``WAIT``, as for records), so a failover of the stream's master cannot lose
an announcement the writer was told of; fewer raise Unavailable, and the writer's retry
announces again. An acknowledgement waits for the replicas too, and fewer raise Unavailable:
a consumer told its group settled commits it, so the acknowledgement must outlive a failover.
The consumer's retry still counts when Redis had applied the first attempt (the claim names
it: ``ack``). Reads (which move entries into a consumer's pending list) are not waited for,
so a consumer can hold an entry that a failover then loses; the sample's next announcement
(the writer's retry) takes over the lost entry's claim (``_claim``).
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence, Set
from typing import NamedTuple

import redis
import redis.cluster

from route_cache.connection import WAIT_TIMEOUT_MS, domain_errors_from_redis, replicated
from route_cache.record_format import (
    dead_letter_key,
    freeing_key,
    record_key,
    routes_key,
    settled_key,
)
from route_cache.store import Announcement, stream_full
from routereplay.domain.feed import ReadyEntry, ReadyPage, ReadyRead
from routereplay.errors import InvalidArgument, RouteReplayError, Unavailable

log = logging.getLogger(__name__)

# A stream entry id, or a bare millisecond part ("0": from the first).
_ENTRY_ID = re.compile(r"\d{1,20}(-\d{1,20})?")


_UINT64_MAX = 2**64 - 1
UPKEEP_WAIT_MS = 200  # the longest the upkeep's ``free`` waits for replicas per round

# KEYS: the stream, a sample's settled hash, the freeing set, the dead-letter stream (all in the
# stream's slot). ARGV: consumer group, the entry, the consumer, the sample, the claim's time to
# live in ms (0: kept), the fence (ms: how long a committed sample's claims are kept), the
# dead-letter reason ('': trained), then the commit groups.
# Claims the sample for the entry unless another claim holds, and acknowledges the entry: one
# script, so a failover of the stream's master keeps both or loses both (two commands on two
# shards, as before issue 47, let a consumer die between them: its claim stood and its entry
# went to a stand-by, which was told "taken", and nobody trained the sample). A claim held by
# an entry the stream lost (absent, and newer than the stream's first entry, so not trimmed:
# read and claimed on the old master, neither reached a replica) passes to this entry: nobody
# was told that entry settled (``ack`` WAITs), and without the handover no announcement of the
# sample could settle it again. Once every commit group holds a claim, the sample joins the
# freeing set: its record, on another slot, is freed from there (``ReadyFeed.free``), never
# by a sample not in it. A sample settled with a reason trained nothing: the claim that first
# takes it for the group adds it to the dead-letter stream (a retry does not again). Returns
# the claim that holds, XACK's count, the lost entry whose claim passed (or ''), 1 when every
# commit group has claimed the sample, and 1 when it was dead-lettered now. At Redis's
# memory limit too (allow-oom): it is what frees memory, and a full Redis must not stop it.
_SETTLE = """#!lua flags=allow-oom
local stream, claims, group, entry = KEYS[1], KEYS[2], ARGV[1], ARGV[2]
local mine = entry .. ' ' .. ARGV[3]
local function id(text)
  local ms, seq = string.match(text, '^(%d+)-?(%d*)$')
  if ms == nil then return nil end
  return {tonumber(ms), tonumber(seq ~= '' and seq or '0')}
end
local taken = redis.call('HSETNX', claims, group, mine)
local claim = redis.call('HGET', claims, group)
local held, lost = string.match(claim, '^(%S+)'), ''
if held ~= entry and #redis.call('XRANGE', stream, held, held, 'COUNT', 1) == 0 then
  local first = redis.call('XRANGE', stream, '-', '+', 'COUNT', 1)
  local h, f = id(held), first[1] and id(first[1][1])
  if h and f and (h[1] > f[1] or (h[1] == f[1] and h[2] > f[2])) then
    redis.call('HSET', claims, group, mine)
    lost, claim = held, mine
  end
end
if tonumber(ARGV[5]) > 0 then
  redis.call('PEXPIRE', claims, ARGV[5])
end
local acked = redis.call('XACK', stream, group, entry)
local dead = 0
if ARGV[7] ~= '' and (taken == 1 or lost ~= '') then
  redis.call('XADD', KEYS[4], 'MAXLEN', '~', 100000, '*', 'sample_id', ARGV[4],
    'consumer_group', group, 'consumer', ARGV[3], 'entry_id', entry, 'reason', ARGV[7])
  dead = 1
end
local committed = 0
if #ARGV > 7 then
  committed = 1
  for i = 8, #ARGV do
    if redis.call('HEXISTS', claims, ARGV[i]) == 0 then committed = 0 end
  end
  if committed == 1 then
    redis.call('PEXPIRE', claims, ARGV[6], 'LT')
    redis.call('SADD', KEYS[3], ARGV[4])
  end
end
return {claim, acked, lost, committed, dead}
"""

# KEYS: the freeing set, a key to write. ARGV: how many samples. Up to that many samples of
# the set, and a write, so that a WAIT after it covers every claim that put them there (WAIT
# counts the replicas holding this connection's writes; a read alone would count them all).
_DUE = """
redis.call('SET', KEYS[2], '1', 'PX', 60000)
return redis.call('SRANDMEMBER', KEYS[1], ARGV[1])
"""

# KEYS: a freed record, its routes. ARGV: the grace (ms). Deletes them if their expiry is
# still within the grace, or the hash is gone (PTTL deletes an expired key it meets; the
# routes may still lie in memory): a record written again under the id since lives its full
# time. At the memory limit too: it frees memory.
_SWEEP = """#!lua flags=allow-oom
local ttl = redis.call('PTTL', KEYS[1])
if ttl == -2 or (ttl >= 0 and ttl <= tonumber(ARGV[1])) then
  return redis.call('UNLINK', KEYS[1], KEYS[2])
end
return 0
"""

# KEYS: the stream. ARGV: its cap (0: none), then the entry's fields and values. Adds the
# entry unless the stream holds the cap already (false: refused, nothing added).
_PUBLISH = """
if tonumber(ARGV[1]) > 0 and redis.call('XLEN', KEYS[1]) >= tonumber(ARGV[1]) then
  return false
end
return redis.call('XADD', KEYS[1], '*', unpack(ARGV, 2))
"""

# KEYS: the stream. ARGV: how long acknowledged entries are kept (ms), then the commit groups.
# Trims the entries every consumer group has acknowledged: those older than the oldest entry
# any group has pending, or has not been delivered yet (just after its last-delivered id), and
# older than the time kept (by Redis's clock, the one entry ids come from). Nothing while a
# commit group does not exist yet: it would read from the stream's start. Returns how many
# entries went.
_TRIM = """
local oldest_ms, oldest_seq = nil, nil
local function keep(id)
  local ms, seq = string.match(id, '(%d+)-(%d+)')
  ms, seq = tonumber(ms), tonumber(seq)
  if oldest_ms == nil or ms < oldest_ms or (ms == oldest_ms and seq < oldest_seq) then
    oldest_ms, oldest_seq = ms, seq
  end
end
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local groups = redis.call('XINFO', 'GROUPS', KEYS[1])
local seen = {}
for _, group in ipairs(groups) do
  local info = {}
  for i = 1, #group, 2 do info[group[i]] = group[i + 1] end
  seen[info['name']] = true
  if tonumber(info['pending']) > 0 then
    keep(redis.call('XPENDING', KEYS[1], info['name'])[2])
  else
    local ms, seq = string.match(info['last-delivered-id'], '(%d+)-(%d+)')
    keep(ms .. '-' .. (tonumber(seq) + 1))
  end
end
for i = 2, #ARGV do
  if not seen[ARGV[i]] then return 0 end
end
if oldest_ms == nil then return 0 end
local now = redis.call('TIME')
local kept_from = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000) - tonumber(ARGV[1])
if kept_from < oldest_ms then oldest_ms, oldest_seq = kept_from, 0 end
return redis.call('XTRIM', KEYS[1], 'MINID', string.format('%d-%d', oldest_ms, oldest_seq))
"""


def _entry_fields(entry: ReadyEntry) -> dict[str, str | int]:
    return {
        "sample_id": entry.sample_id,
        "group_id": entry.group_id,
        "num_tokens": entry.num_tokens,
        "policy_versions": ",".join(str(v) for v in entry.policy_versions),
    }


class Backlog(NamedTuple):
    """A consumer group's backlog: entries not yet delivered to it (None where Redis cannot
    tell: an entry was deleted or trimmed inside the group's unread range), entries delivered
    and not acknowledged, and the stream time (ms since the epoch) of the oldest entry it has
    pending or not yet delivered (None: neither)."""

    group: str
    unread: int | None
    unacked: int
    oldest_ms: int | None


def check_entry_id(entry_id: str, name: str) -> None:
    """Refuse what Redis would refuse: both parts of ``<ms>-<seq>`` are unsigned 64-bit."""
    if not _ENTRY_ID.fullmatch(entry_id) or any(
        int(part) > _UINT64_MAX for part in entry_id.split("-")
    ):
        raise InvalidArgument(f"{name} {entry_id[:64]!r} is not a stream entry id (<ms>-<seq>)")


class ReadyFeed:
    """Publishes, reads and acknowledges ready entries, and frees what every commit group
    acknowledged.

    Args:
        client: a ``redis.Redis`` or ``redis.cluster.RedisCluster`` (passed in, never global).
        stream: the stream's key.
        maxlen: the most entries the stream may hold (0: no cap). At the cap, a write's
            announcement is refused (ResourceExhausted, nothing stored where the stream
            shares the record's server) rather than the oldest entries dropped: entries leave
            the stream once every consumer group has acknowledged them (``trim``).
        wait_replicas, wait_timeout_ms: replicas that must hold an announcement or an
            acknowledgement before it is answered (see the module docstring), and how long to
            wait for them.
        settled_ttl_ms: how long a sample's claim by the entry that settled it is kept (the
            records' time to live: a repeat can only announce a stored record); 0 keeps it.
        commit_groups: the consumer groups that must each acknowledge a sample before its
            record is freed (none: records live out their time to live).
        free_grace_ms: how long a freed record stays readable (a debugging re-read).
        fence_ms: how long a freed sample's claims are kept: a writer's late retry of a
            freed record is stored and announced again, and the claims then tell the
            consumers it was trained (and free it again).
        keep_acked_ms: how long acknowledged entries stay in the stream: a consumer whose
            acknowledgement's answer was lost retries it, and the retry finds its sample's
            claim through the entry (see ``ack``).
    """

    def __init__(
        self,
        client,
        stream: str,
        maxlen: int = 100_000,
        wait_replicas: int = 0,
        wait_timeout_ms: int = WAIT_TIMEOUT_MS,
        settled_ttl_ms: int = 0,
        commit_groups: Sequence[str] = (),
        free_grace_ms: int = 60_000,
        fence_ms: int = 3_600_000,
        keep_acked_ms: int = 300_000,
    ):
        self.client = client
        self.stream = stream
        self.maxlen = maxlen
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self.settled_ttl_ms = settled_ttl_ms
        self.commit_groups = tuple(commit_groups)
        self.free_grace_ms = free_grace_ms
        self.fence_ms = max(fence_ms, free_grace_ms)
        self.keep_acked_ms = keep_acked_ms
        self.freed = 0  # records freed by this process's acknowledgements
        self._freeing: deque[tuple[float, str]] = deque()  # (grace's end, sample): to sweep
        self._lock = threading.Lock()
        self.trimmed = 0  # stream entries trimmed by this process
        self.dead_lettered = 0  # samples this process added to the dead-letter stream

    def announcement(self, entry: ReadyEntry) -> Announcement | None:
        """``entry`` for a record's commit to add, where the stream shares the record's
        server (a single Redis); None in a Cluster (``publish`` it after the commit)."""
        if isinstance(self.client, redis.cluster.RedisCluster):
            return None
        return Announcement(self.stream, self.maxlen, _entry_fields(entry))

    def publish(self, entry: ReadyEntry) -> str:
        """Append ``entry`` (its ``entry_id`` is ignored). Returns the new entry id.

        Raises:
            ResourceExhausted: the stream holds ``maxlen`` entries.
        """
        args = [self.maxlen, *(part for item in _entry_fields(entry).items() for part in item)]
        with domain_errors_from_redis():
            if not self.wait_replicas:
                entry_id = self.client.eval(_PUBLISH, 1, self.stream, *args)
            else:
                (entry_id,), replicas = self._replicated(
                    lambda pipe: pipe.eval(_PUBLISH, 1, self.stream, *args)
                )
                if replicas < self.wait_replicas and entry_id is not None:
                    raise Unavailable(
                        f"{replicas} of {self.wait_replicas} replicas confirmed the "
                        f"announcement of {entry.sample_id!r} within {self.wait_timeout_ms} ms"
                    )
        if entry_id is None:
            raise stream_full(self.stream, self.maxlen)
        return _text(entry_id)

    def read(self, read: ReadyRead) -> ReadyPage:
        """Entries for ``read.consumer`` of ``read.consumer_group``, from the first of three
        stages that has any:

        1. with ``pending_cursor``: this consumer's pending entries after that id;
        2. with ``claim_idle_ms``: entries pending that long with any consumer, now its own
           (``XAUTOCLAIM`` from ``claim_cursor``);
        3. new entries, waiting up to ``block_ms`` (0: not at all) for one.

        The group is created on first use (with the stream, if need be), reading from the
        stream's first entry, or from its end with ``start_from_latest``.
        """
        group, consumer, count = read.consumer_group, read.consumer, read.max_entries
        pending_cursor, claim_idle_ms = read.pending_cursor, read.claim_idle_ms
        start_from_latest, block_ms = read.start_from_latest, read.block_ms
        claim_cursor = read.claim_cursor or "0-0"
        with domain_errors_from_redis():
            if pending_cursor:
                found = _stream_entries(
                    self._in_group(
                        group,
                        start_from_latest,
                        lambda: self.client.xreadgroup(
                            group, consumer, {self.stream: pending_cursor}, count=count
                        ),
                    )
                )
                if found:
                    entries, lost = self._parse(group, found)
                    cursor = _text(found[-1][0]) if len(found) == count else ""
                    return ReadyPage(entries, cursor, claim_cursor, lost)
            if claim_idle_ms:
                result = self._in_group(
                    group,
                    start_from_latest,
                    lambda: self.client.xautoclaim(
                        self.stream, group, consumer, claim_idle_ms, claim_cursor, count=count
                    ),
                )
                claim_cursor = _text(result[0])
                deleted = result[2] if len(result) > 2 else []  # trimmed: Redis dropped them
                if result[1] or deleted:
                    entries, lost = self._parse(group, result[1])
                    return ReadyPage(entries, "", claim_cursor, lost + len(deleted))
            found = _stream_entries(
                self._in_group(
                    group,
                    start_from_latest,
                    lambda: self.client.xreadgroup(
                        group, consumer, {self.stream: ">"}, count=count, block=block_ms or None
                    ),
                )
            )
            entries, lost = self._parse(group, found)
        return ReadyPage(entries, "", claim_cursor, lost)

    def backlog(self) -> list[Backlog]:
        """Each consumer group's ``Backlog``."""
        try:
            groups = self.client.xinfo_groups(self.stream)
        except redis.exceptions.ResponseError:  # no stream yet
            return []
        found = []
        for group in groups:
            name, pending = _text(group["name"]), int(group["pending"])
            if pending:
                first = self.client.xpending(self.stream, name)["min"]
            else:
                after = self.client.xrange(
                    self.stream, min=f"({_text(group['last-delivered-id'])}", count=1
                )
                first = after[0][0] if after else None
            oldest = None if first is None else _id(_text(first))[0]
            found.append(Backlog(name, group.get("lag"), pending, oldest))
        return found

    def ack(
        self,
        group: str,
        entry_ids: Sequence[str],
        consumer: str = "",
        sample_ids: Sequence[str] = (),
        dead_letters: Set[str] = frozenset(),
        reason: str = "",
    ) -> int:
        """Acknowledge entries of ``group``. Returns how many this call settled: entries it
        took off the pending list whose sample no other entry settled in ``group`` first.

        A sample can be announced twice (a retried write or final append announces again),
        and two consumers of a group can each hold one of its entries; both train it. The
        first to acknowledge its entry claims the sample (``settled_key``, in the stream's
        slot: consumer group -> entry id and ``consumer``, kept as long as records are); the
        other's entry is
        acknowledged but not counted, so ``ReadyConsumer.settle`` tells it not to commit.
        Entries of one sample acknowledged in one call (a repeat filed with its group) count
        alike. The claim and the acknowledgement are one script on the stream's slot
        (``_SETTLE``), and a named consumer's retry that
        finds its own claim counts even when XACK finds nothing pending any more (its first
        answer was lost: say, past its deadline while the consumer was paused); a named
        consumer counts only its own claims. An entry the stream no longer has (trimmed, or
        lost in a failover of its master: read from the old master, it never reached the
        promoted replica) claims nothing; named with its sample (``sample_ids``, the caller's
        record of what it read), it counts as that sample's other entries in this call do,
        and on its acknowledgement alone otherwise.

        ``dead_letters``: samples the consumer settles without training them (their record
        was lost after the announcement); the first claim of each in ``group`` adds it to the
        dead-letter stream (``dead_letter_key``) with ``reason``, logs it and counts it
        (``dead_lettered``). An entry of one the stream no longer has cannot carry it there.

        Raises:
            Unavailable: Fewer than ``wait_replicas`` replicas confirmed the acknowledgement.
        """
        with domain_errors_from_redis():
            samples = self._samples(entry_ids)
            if self.wait_replicas:
                replies, replicas = self._replicated(
                    lambda pipe: self._queue_settle(
                        pipe, group, entry_ids, consumer, samples, dead_letters, reason
                    )
                )
                if replicas < self.wait_replicas:
                    raise Unavailable(
                        f"{replicas} of {self.wait_replicas} replicas confirmed an "
                        f"acknowledgement on {group!r} within {self.wait_timeout_ms} ms"
                    )
            else:
                pipe = self.client.pipeline(transaction=False)
                self._queue_settle(pipe, group, entry_ids, consumer, samples, dead_letters, reason)
                replies = pipe.execute()
            owners, acked, committed = {}, [], []
            for entry_id, reply in zip(entry_ids, replies, strict=True):
                if entry_id not in samples:  # gone from the stream: XACK alone
                    acked.append(int(reply))
                    continue
                claim, n, lost, all_committed, dead = reply
                if int(dead):
                    self.dead_lettered += 1
                    log.warning(
                        "sample %r dead-lettered by %r of %r (entry %s): %s",
                        samples[entry_id],
                        consumer,
                        group,
                        entry_id,
                        reason,
                    )
                owners[entry_id] = _owner(_text(claim))
                acked.append(int(n))
                if _text(lost):
                    log.warning(
                        "sample %r: its claim in %r by entry %s, which the stream lost, now %s",
                        samples[entry_id],
                        group,
                        _text(lost),
                        _text(claim),
                    )
                if int(all_committed):
                    committed.append(samples[entry_id])
        # Replicated (or not asked to be): the claims that committed them will outlive a
        # failover, so their records may go now. A records' shard that fails here must not fail
        # the acknowledgement, which is done: the freeing set keeps them for the upkeep.
        if committed:
            try:
                self.free(committed)
            except RouteReplayError:
                log.warning("freeing %d committed records left to the upkeep", len(committed))
        ours = set(entry_ids)  # a repeat acknowledged with its sample's first entry counts
        counted = {}
        for entry_id, n in zip(entry_ids, acked, strict=True):
            if entry_id in owners:
                owner, by = owners[entry_id]
                # Named, the claim says who settled: its retries count, and nobody else, even
                # one whose XACK counts (the entry delivered again after a failover lost the
                # first consumer's delivery and acknowledgement).
                counted[entry_id] = owner in ours and (by == consumer if consumer else bool(n))
        by_sample = {}
        for entry_id, sample_id in samples.items():
            by_sample[sample_id] = by_sample.get(sample_id, False) or counted[entry_id]
        named = dict(zip(entry_ids, sample_ids, strict=True)) if sample_ids else {}
        settled = 0
        for entry_id, n in zip(entry_ids, acked, strict=True):
            if entry_id in counted:
                settled += counted[entry_id]
            elif named.get(entry_id) in by_sample:  # gone from the stream: as its sample
                settled += by_sample[named[entry_id]]
            else:  # trimmed or lost, its sample unknown here: no claim to weigh
                settled += bool(n)
        if settled < len(entry_ids):  # the consumer is told not to commit: say why
            log.info(
                "acknowledgement on %r by %r settled %d of %d: entries %s, their samples in "
                "the stream %s, claims %s, XACK %s",
                group,
                consumer,
                settled,
                len(entry_ids),
                list(entry_ids),
                samples,
                owners,
                list(acked),
            )
        return settled

    def free(self, samples: Sequence[str] | None = None, count: int = 512) -> int:
        """Free the records of ``samples`` (all in the freeing set: every commit group
        settled them), or, with None, of up to ``count`` of the set's samples (the route
        cache's ``Upkeep`` runs it every second: samples whose acknowledgement was not
        answered, or whose acknowledging process died before freeing them). Each record's
        expiry comes down to the grace (``PEXPIRE LT``: never lengthened, so a repeat changes
        nothing), then the sample leaves the set: a process that dies between the two leaves
        it for the next call. Returns how many records this call freed."""
        freeing = freeing_key(self.stream)
        with domain_errors_from_redis():
            if samples is None:
                if not self.client.scard(freeing):  # the usual case: nothing to WAIT for
                    return 0
                marker = f"{freeing}:waited"
                if self.wait_replicas:  # only what a failover of the set's master keeps
                    # Briefly: the upkeep thread also reads the memory budget, and a replica
                    # that is down must not hold that up; the next round tries again.
                    due, replicas = replicated(
                        self.client,
                        self.stream,
                        lambda pipe: pipe.eval(_DUE, 2, freeing, marker, count),
                        self.wait_replicas,
                        min(self.wait_timeout_ms, UPKEEP_WAIT_MS),
                    )
                    if replicas < self.wait_replicas:
                        return 0
                    due = due[0]
                else:
                    due = self.client.eval(_DUE, 2, freeing, marker, count)
                samples = [_text(s) for s in due or ()]
            if not samples:
                return 0
            pipe = self.client.pipeline(transaction=False)
            for sample_id in samples:
                pipe.pexpire(record_key(sample_id), self.free_grace_ms, lt=True)
                pipe.pexpire(routes_key(sample_id), self.free_grace_ms, lt=True)
            replies = pipe.execute()
            self.client.srem(freeing, *samples)
        freed = [s for s, r in zip(samples, replies[::2], strict=True) if r]
        if freed:
            due_at = time.monotonic() + self.free_grace_ms / 1000
            with self._lock:
                self.freed += len(freed)
                self._freeing.extend((due_at, sample_id) for sample_id in freed)
        return len(freed)

    def forget(self, sample_id: str) -> None:
        """Drop a deleted sample's claims: a record written again under its id is announced
        again, and trained anew."""
        with domain_errors_from_redis():
            self.client.delete(settled_key(self.stream, sample_id))
            self.client.srem(freeing_key(self.stream), sample_id)

    def sweep(self) -> int:
        """Delete the records this process freed whose grace is over. Redis's own expiry
        would delete them too, but it finds expired keys by sampling: with many keys that
        have a time to live (the claims' hour) it can take minutes, while they hold memory.
        Returns how many went; records freed by a process that has stopped are left to
        Redis's expiry."""
        now, due = time.monotonic(), []
        with self._lock:
            while self._freeing and self._freeing[0][0] <= now:
                due.append(self._freeing.popleft()[1])
        if not due:
            return 0
        with domain_errors_from_redis():
            pipe = self.client.pipeline(transaction=False)
            for sample_id in due:
                keys = (record_key(sample_id), routes_key(sample_id))
                pipe.eval(_SWEEP, 2, *keys, self.free_grace_ms)
            return sum(1 for deleted in pipe.execute() if deleted)

    def trim(self) -> int:
        """Drop the entries every consumer group has acknowledged (never one that a group
        has pending or has not been delivered; nothing while a commit group is missing).
        Returns how many went. The route cache runs it every second (``Upkeep``)."""
        with domain_errors_from_redis():
            trimmed = int(
                self.client.eval(_TRIM, 1, self.stream, self.keep_acked_ms, *self.commit_groups)
            )
        self.trimmed += trimmed
        return trimmed

    def _samples(self, entry_ids: Sequence[str]) -> dict[str, str]:
        """The sample id of each entry still in the stream."""
        pipe = self.client.pipeline(transaction=False)
        for entry_id in entry_ids:
            pipe.xrange(self.stream, min=entry_id, max=entry_id, count=1)
        samples = {}
        for entry_id, found in zip(entry_ids, pipe.execute(), strict=True):
            # A bare "<ms>" as the range's end reaches past "<ms>-0", the entry XACK means.
            full_id = entry_id if "-" in entry_id else f"{entry_id}-0"
            entry = _entry(_text(found[0][0]), found[0][1]) if found else None
            if entry is not None and entry.entry_id == full_id:
                samples[entry_id] = entry.sample_id
        return samples

    def _queue_settle(
        self,
        pipe,
        group: str,
        entry_ids: Sequence[str],
        consumer: str,
        samples: dict[str, str],
        dead_letters: Set[str],
        reason: str,
    ) -> None:
        """Queue, per entry, the claim and XACK of ``_SETTLE`` (an entry still in the stream)
        or XACK alone (one gone: nothing to claim by), all on the stream's slot."""
        freeing, dead = freeing_key(self.stream), dead_letter_key(self.stream)
        for entry_id in entry_ids:
            sample_id = samples.get(entry_id)
            if sample_id is None:
                pipe.xack(self.stream, group, entry_id)
                continue
            keys = (self.stream, settled_key(self.stream, sample_id), freeing, dead)
            why = reason if sample_id in dead_letters else ""
            args = (group, entry_id, consumer, sample_id, self.settled_ttl_ms, self.fence_ms, why)
            args += self.commit_groups
            pipe.execute_command("EVAL", _SETTLE, len(keys), *keys, *args)

    def _replicated(self, queue) -> tuple[object, int]:
        """The one command ``queue(pipe)`` queues, then WAIT, on the stream's master."""
        return replicated(self.client, self.stream, queue, self.wait_replicas, self.wait_timeout_ms)

    def _in_group(self, group: str, start_from_latest: bool, call: Callable):
        """``call()``, creating the consumer group first when Redis says it does not exist."""
        try:
            return call()
        except redis.ResponseError as exc:
            if not str(exc).startswith("NOGROUP"):
                raise
        try:
            self.client.xgroup_create(
                self.stream, group, id="$" if start_from_latest else "0", mkstream=True
            )
            log.info("created consumer group %r on %r", group, self.stream)
        except redis.ResponseError as exc:
            if not str(exc).startswith("BUSYGROUP"):  # another replica created it meanwhile
                raise
        return call()

    def _parse(self, group: str, found: list) -> tuple[list[ReadyEntry], int]:
        """The entries of a read, and how many were lost: pending entries whose stream entry
        was trimmed (no fields) or that cannot be read; those are acknowledged here."""
        entries, lost = [], []
        for raw_id, fields in found:
            entry = _entry(_text(raw_id), fields) if raw_id is not None else None
            if entry is not None:
                entries.append(entry)
            elif raw_id is not None:
                lost.append(_text(raw_id))
        if lost:
            log.warning("%d pending entries of %r were trimmed or unreadable", len(lost), group)
            self.client.xack(self.stream, group, *lost)
        return entries, len(lost)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _owner(claim: str) -> tuple[str, str]:
    """(entry id, consumer) of a claim."""
    entry_id, _, consumer = claim.partition(" ")
    return entry_id, consumer


def _id(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def _stream_entries(found) -> list:
    """``[(id, fields), ...]`` of the one stream read, whichever reply shape redis-py gives."""
    if not found:
        return []
    if isinstance(found, dict):
        (value,) = found.values()
        return value[0] if value and isinstance(value[0], list) else value
    return found[0][1]


def _entry(entry_id: str, fields: dict | None) -> ReadyEntry | None:
    if not fields:
        return None
    fields = {_text(k): _text(v) for k, v in fields.items()}
    try:
        versions = fields.get("policy_versions", "")
        return ReadyEntry(
            entry_id,
            fields["sample_id"],
            fields.get("group_id", ""),
            int(fields.get("num_tokens", 0)),
            tuple(int(v) for v in versions.split(",")) if versions else (),
        )
    except (KeyError, ValueError):
        return None
