"""Records in Redis or Redis Cluster, through one code path.

The layout (storage format 3: per record a hash of small fields and one layer-major routes
string, in one Cluster slot) and the parsing of what is read back are
``route_cache.record_format``'s. A write is one SET of the routes (into a staging key) and a
small commit script, in one round trip (on a single Redis the script also adds the ready
feed's entry: ``Announcement``); a whole read one GET of the routes and one HGETALL
of the small fields; a read of a layer range (a pipeline stage) one GETRANGE per run of
layers per block, after the small fields (two round trips per window of records).

Consistency: committed bytes never change (appends add blocks at the end of the routes value
and a descriptor in the hash). A whole read runs ``HGET gen``, ``GET routes``, ``HGETALL``;
a stage read ``HGETALL``, then the ``GETRANGE``s and ``HGET gen``. The same ``gen`` at both
ends means no other record was committed under the id in between (``gen`` is random), so the
bytes read are this record's; blocks appended meanwhile are left out (their bytes lie past
what the read holds, or their descriptor is newer than it); a record deleted or expired
meanwhile reads as absent.

Storage formats 1 (one route field ``r@<row_start>`` per block) and 2 (one hash field
``r@<row_start>:<j>`` per MoE layer) were one hash per record. Records in them are still
read, whole (formats 1 and 2) and by layer selection (format 2: the hash is fetched whole and
the selected parts sent). A layer selection of a format-1 record and an append to a record
in either format are refused (FailedPrecondition, saying what to do: they expire after their
TTL, or read them whole, delete and write them again).

A new record's routes are first SET into a staging key ``rr:{<sample_id>}:stage:<random>``,
born with a 10-minute expiry; the commit script (pipelined right behind it) then sets the
small fields and RENAMEs the staging key into place, only when the id is free (or reports a
duplicate or a conflict): a reader sees a record whole or not at all, and a staging key left
by a writer that died expires on its own. An append is one Lua script that checks the row
count it expects and APPENDs the block in the same atomic step.

With ``wait_replicas`` set, a write or append is acknowledged only once Redis ``WAIT`` reports
that many replicas hold it (sent on the connection that made the write, to the key's master);
fewer within ``wait_timeout_ms`` raise Unavailable, and the caller's retry finds the record
stored (a duplicate) or writes it again. This is not strong consistency: the write stays on the
master if WAIT falls short, and a replica that has a write in memory can still lose it (a
failover can promote another replica, or a replica can restart without persistence). It closes
the window in which a master is killed between its reply and asynchronous replication.
"""

from __future__ import annotations

import hashlib
import secrets
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import redis
import redis.cluster

from route_cache import record_format
from route_cache.connection import (
    WAIT_TIMEOUT_MS,
    domain_errors_from_redis,
    is_connection_error,
    replicated,
)
from route_cache.record_format import (
    RecordStat,
    StoredBlock,
    StoredRecord,
    record_key,
    routes_key,
)
from routereplay.domain.record import Geometry
from routereplay.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)

# KEYS: record, routes, staging, and the ready stream when the commit announces the record.
# ARGV: geometry JSON, group, block field, block descriptor, tokens field, tokens, rows, ttl,
# gen, then the stream's cap (0: none) and the entry's fields and values. A stream at its cap
# refuses the write before anything changes (-3). The small fields go first: HSET is the only
# command Redis may refuse at its memory limit, and then nothing has changed (a script that
# has written may go on writing: the XADD too).
_COMMIT = """
local function announce(result)
  if KEYS[4] then
    redis.call('XADD', KEYS[4], '*', unpack(ARGV, 11))
  end
  return result
end
if redis.call('EXISTS', KEYS[3]) == 0 then return -2 end
if KEYS[4] and tonumber(ARGV[10]) > 0
    and redis.call('XLEN', KEYS[4]) >= tonumber(ARGV[10]) then
  redis.call('DEL', KEYS[3])
  return -3
end
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('DEL', KEYS[3])
  if redis.call('HGET', KEYS[1], 'geometry') == ARGV[1]
      and redis.call('HGET', KEYS[1], 'group') == ARGV[2]
      and redis.call('HGET', KEYS[1], ARGV[3]) == ARGV[4] then
    return announce(1)
  end
  return -1
end
local rows = tonumber(ARGV[7])
redis.call('HSET', KEYS[1], 'geometry', ARGV[1], 'group', ARGV[2], 'rows', rows,
           'tokens', rows + 1, 'bytes', redis.call('STRLEN', KEYS[3]), 'gen', ARGV[9],
           ARGV[3], ARGV[4], ARGV[5], ARGV[6])
redis.call('RENAME', KEYS[3], KEYS[2])
if tonumber(ARGV[8]) > 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[8])
  redis.call('PEXPIRE', KEYS[2], ARGV[8])
else
  redis.call('PERSIST', KEYS[2])
end
return announce(0)
"""

STAGING_TTL_MS = 600_000

# KEYS: record, routes. ARGV: geometry JSON, row offset, rows added, ttl, descriptor field,
# descriptor, tokens field, tokens, route bytes.
_APPEND = """
local rows = redis.call('HGET', KEYS[1], 'rows')
if not rows then return {-2, 0} end
if redis.call('HGET', KEYS[1], 'geometry') ~= ARGV[1] then return {-3, 0} end
rows = tonumber(rows)
local offset = tonumber(ARGV[2])
if offset == rows then
  local stored = tonumber(redis.call('HGET', KEYS[1], 'bytes'))
  if redis.call('STRLEN', KEYS[2]) ~= stored then return {-4, rows} end
  local added = tonumber(ARGV[3])
  redis.call('HSET', KEYS[1], 'rows', rows + added, 'tokens', rows + added + 1,
             'bytes', stored + string.len(ARGV[9]), ARGV[5], ARGV[6], ARGV[7], ARGV[8])
  redis.call('APPEND', KEYS[2], ARGV[9])
  if tonumber(ARGV[4]) > 0 then
    redis.call('PEXPIRE', KEYS[1], ARGV[4])
    redis.call('PEXPIRE', KEYS[2], ARGV[4])
  end
  return {0, rows + added}
end
if offset < rows and redis.call('HGET', KEYS[1], ARGV[5]) == ARGV[6] then
  return {1, rows}
end
return {-1, rows}
"""


@dataclass(frozen=True)
class Announcement:
    """A stream entry for a write's commit to add: ``fields`` to ``stream``, refused when
    the stream holds ``maxlen`` entries (0: no cap). All its keys must share the record's
    server."""

    stream: str
    maxlen: int
    fields: dict[str, str | int]


def stream_full(stream: str, maxlen: int) -> ResourceExhausted:
    """The refusal of an announcement at the ready stream's cap."""
    return ResourceExhausted(
        f"the ready stream {stream!r} holds {maxlen} entries, its cap (--ready-maxlen): its "
        "consumers are that far behind. Entries leave as every consumer group acknowledges "
        "them; nothing was stored, retry later",
        retry_after_s=1.0,
    )


# Route bytes a whole-record read fetches per round trip (``RouteStore``): one 32K-token
# Qwen3-30B-A3B record, which was a window of its own before windows were sized in bytes; a
# read of smaller records holds no more memory than a read of those did (each of up to
# ``max_concurrent_rpcs`` reads holds a window, the next one and the one being sent).
BATCH_BYTES = 12 << 20

# Times a read starts again when another record was committed under its id while it read
# (a delete and a new write between its two ends: gen changed).
_READ_ATTEMPTS = 3


class RouteStore:
    """Reads and writes records; see the module docstring for the layout.

    Args:
        client: a ``redis.Redis`` or ``redis.cluster.RedisCluster`` (passed in, never global).
        ttl_ms: records expire this long after their last write; 0 keeps them.
        batch_bytes: route bytes a whole-record read fetches per pipeline round trip. The
            first window is one record; each next one holds as many records as fit in
            ``batch_bytes`` at the largest record read so far. The next window is fetched while
            this one is sent, so Redis and gRPC overlap. Measured on batch reads (this
            storage format, 2 cores, against the gRPC + Redis floor): 8 records of 4K tokens
            (1.5 MiB) per window 0.92 of the floor, 1 record 0.74; 32K-token records (12 MiB)
            1 per window 0.76, 2 0.81, 4 0.56 (a 48 MiB reply outgrows the heap's reused
            buffers, ``routereplay.allocator``).
        batch_window: at most this many records per window (bounds a window whose records
            are larger than any read before them).
        wait_replicas: replicas that must confirm a write or append before it is acknowledged
            (Redis ``WAIT``); 0 acknowledges once the master has it.
        wait_timeout_ms: how long ``WAIT`` may block before the write counts as unconfirmed.
        stage_window: records fetched per window by a layer-selected read (two round trips
            per window: the small fields, then the ranges).
    """

    def __init__(
        self,
        client,
        ttl_ms: int = 0,
        batch_bytes: int = BATCH_BYTES,
        batch_window: int = 16,
        wait_replicas: int = 0,
        wait_timeout_ms: int = WAIT_TIMEOUT_MS,
        stage_window: int = 8,
    ):
        self.client = client
        self.stage_window = stage_window
        self.ttl_ms = ttl_ms
        self.batch_bytes = batch_bytes
        self.batch_window = batch_window
        self.wait_replicas = wait_replicas
        self.wait_timeout_ms = wait_timeout_ms
        self._commit = client.register_script(_COMMIT)
        self._append = client.register_script(_APPEND)

    def ping(self) -> bool:
        """Whether Redis answers; False when it cannot be reached. Blocks up to the client's
        socket time-out on a Redis that accepts connections but does not answer."""
        try:
            return bool(self.client.ping())
        except Exception as exc:
            if is_connection_error(exc):
                return False
            raise

    def write(
        self,
        sample_id: str,
        group_id: str,
        geometry: Geometry,
        block: StoredBlock,
        announcement: Announcement | None = None,
    ) -> bool:
        """Store a new record made of ``block``. Returns True when an identical record was
        already stored (a retry).

        ``announcement``: a stream entry added by the commit itself when it stores the record
        or finds it stored (the ready feed on a single Redis: no second round trip).

        Raises:
            AlreadyExists: a different record has this id.
        """
        desc, tokens, value = record_format.block_fields(block, geometry)
        key, geometry_field = record_key(sample_id), record_format.geometry_json(geometry)
        staging = f"{key}:stage:{secrets.token_hex(8)}"
        keys = [key, routes_key(sample_id), staging]
        args = [
            geometry_field,
            group_id,
            f"b@{block.row_start}",
            desc,
            f"t@{block.row_start}",
            tokens,
            block.routes.num_rows,
            self.ttl_ms,
            secrets.token_hex(8),
        ]
        if announcement is not None:
            keys.append(announcement.stream)
            args.append(announcement.maxlen)
            args.extend(part for item in announcement.fields.items() for part in item)

        def queue(pipe):
            # The routes go as the value of a plain SET, born with the staging expiry: Redis
            # takes a megabyte argument there without copying it again (a script argument
            # is copied three times; one inside a MULTI is queued first).
            pipe.set(staging, value, px=STAGING_TTL_MS)
            _evalsha(pipe, _COMMIT, keys, args)

        result = self._run(key, queue)[-1]
        if result == -2:
            raise Unavailable(f"the staged record of {sample_id!r} vanished before its commit")
        if result == -3:
            raise stream_full(announcement.stream, announcement.maxlen)
        if result == -1:
            self._refuse_old_format(sample_id, "written again")
            raise AlreadyExists(f"sample_id {sample_id!r} already holds a different record")
        return result == 1

    def append(self, sample_id: str, geometry: Geometry, block: StoredBlock) -> tuple[bool, int]:
        """Append ``block`` at ``block.row_start``, which must equal the stored row count.

        Returns:
            (duplicate, rows): duplicate is True when this very block was already appended.

        Raises:
            NotFound, InvalidArgument (geometry differs), FailedPrecondition (stale offset, or
            a record in an older storage format).
        """
        desc, tokens, value = record_format.block_fields(block, geometry)
        offset = block.row_start
        key = record_key(sample_id)
        keys = [key, routes_key(sample_id)]
        args = [
            record_format.geometry_json(geometry),
            offset,
            block.routes.num_rows,
            self.ttl_ms,
            f"b@{offset}",
            desc,
            f"t@{offset}",
            tokens,
            value,
        ]
        status, rows = self._run(key, lambda pipe: _evalsha(pipe, _APPEND, keys, args))[-1]
        if status == -2:
            raise NotFound(f"no record for sample_id {sample_id!r}")
        if status == -3:
            self._refuse_old_format(sample_id, "appended to")
            raise InvalidArgument(
                f"geometry differs from the stored record of {sample_id!r}: appends must keep it"
            )
        if status == -4:  # the routes expired a moment before the rest of the record
            raise NotFound(f"no record for sample_id {sample_id!r} (it is expiring)")
        if status == -1:
            raise FailedPrecondition(
                f"append at row_offset {offset} refused: the record of {sample_id!r} has {rows} "
                "rows (a stale or out-of-order append)"
            )
        return status == 1, int(rows)

    def _run(self, key: str, queue) -> list:
        """The commands ``queue(pipe)`` puts on a pipeline, in one round trip to ``key``'s
        master; with ``wait_replicas``, confirmed by that many replicas (WAIT, same trip).
        Scripts go by their hash; Redis not knowing them (a restart, a failover) loads them
        and runs the commands again (each is safe to run twice).

        Raises:
            Unavailable: fewer replicas than ``wait_replicas`` confirmed in time.
        """
        with domain_errors_from_redis():
            try:
                results, replicas = replicated(
                    self.client, key, queue, self.wait_replicas, self.wait_timeout_ms
                )
            except redis.exceptions.NoScriptError:
                self._load_scripts(key)
                results, replicas = replicated(
                    self.client, key, queue, self.wait_replicas, self.wait_timeout_ms
                )
        if replicas < self.wait_replicas:
            raise Unavailable(
                f"{replicas} of {self.wait_replicas} replicas confirmed the write of {key} "
                f"within {self.wait_timeout_ms} ms"
            )
        return results

    def _load_scripts(self, key: str) -> None:
        node = self.client
        if isinstance(node, redis.cluster.RedisCluster):
            node = node.get_redis_connection(node.get_node_from_key(key))
        for source in (_COMMIT, _APPEND):
            node.script_load(source)

    def _refuse_old_format(self, sample_id: str, what: str) -> None:
        """Raise FailedPrecondition when the record is in an older storage format."""
        with domain_errors_from_redis():
            stored = self.client.hget(record_key(sample_id), "geometry")
        version = record_format.stored_format(stored)
        if version in record_format.LEGACY_FORMATS:
            raise FailedPrecondition(record_format.old_format_message(sample_id, what, version))

    def read(self, sample_id: str, layers: tuple[int, ...] | None = None) -> StoredRecord:
        record = next(self.read_many([sample_id], layers))
        if record is None:
            raise NotFound(f"no record for sample_id {sample_id!r}")
        return record

    def read_many(
        self, sample_ids: Sequence[str], layers: tuple[int, ...] | None = None
    ) -> Iterator[StoredRecord | None]:
        """Records in the order asked (None for unknown ids), a window of them per fetch
        (one round trip, two with ``layers``; see ``batch_bytes``), so a large batch streams
        instead of sitting in memory whole. The next window is fetched while the caller
        consumes this one.

        Args:
            layers: MoE layer indices (checked ascending by the caller): only their route
                bytes are fetched from Redis (one range per run of consecutive layers per
                block). None: every layer.

        Raises:
            InvalidArgument: ``layers`` reaches beyond a record's geometry.
            FailedPrecondition: ``layers`` given for a record in storage format 1.
        """
        # A stage read fetches a fixed number of records per window: it takes two round
        # trips, and moves a fraction of each record's bytes.
        size = 1 if layers is None else self.stage_window
        if len(sample_ids) <= size:  # one window: no thread to start (a read of one record)
            yield from self._fetch(sample_ids, layers)
            return
        largest = 0
        with ThreadPoolExecutor(max_workers=1) as prefetch:
            pending = prefetch.submit(self._fetch, sample_ids[:size], layers)
            start = size
            while pending is not None:
                records = pending.result()
                pending = None
                if start < len(sample_ids):
                    if layers is None:
                        largest = max([largest, *(r.route_bytes for r in records if r)])
                        size = max(1, min(self.batch_window, self.batch_bytes // max(largest, 1)))
                    pending = prefetch.submit(self._fetch, sample_ids[start : start + size], layers)
                    start += size
                yield from records

    def _fetch(
        self, window: Sequence[str], layers: tuple[int, ...] | None
    ) -> list[StoredRecord | None]:
        """The records of ``window`` (None: no record), read again where another record was
        committed under the id while they were read."""
        records: list[StoredRecord | None] = [None] * len(window)
        todo = list(range(len(window)))
        for _ in range(_READ_ATTEMPTS):
            read = self._fetch_once([window[i] for i in todo], layers)
            again = []
            for i, record in zip(todo, read, strict=True):
                if record is record_format.CHANGED:
                    again.append(i)
                else:
                    records[i] = record
            if not again:
                return records
            todo = again
        raise Unavailable(
            f"records {[window[i] for i in todo]} were rewritten under their ids on every "
            f"one of {_READ_ATTEMPTS} reads"
        )

    def _fetch_once(self, window: Sequence[str], layers: tuple[int, ...] | None) -> list:
        with domain_errors_from_redis():
            pipe = self.client.pipeline(transaction=False)
            for sample_id in window:
                key = record_key(sample_id)
                if layers is None:
                    pipe.hget(key, "gen")
                    pipe.get(routes_key(sample_id))
                pipe.hgetall(key)
            replies = pipe.execute()
        if layers is None:
            return [
                record_format.whole_record(sample_id, *replies[3 * i : 3 * i + 3])
                for i, sample_id in enumerate(window)
            ]
        # A stage: the small fields first, then one range per run of layers per block.
        heads = [
            record_format.stage_head(sample_id, fields, layers)
            for sample_id, fields in zip(window, replies, strict=True)
        ]
        with domain_errors_from_redis():
            pipe = self.client.pipeline(transaction=False)
            for sample_id, head in zip(window, heads, strict=True):
                if isinstance(head, record_format.Head):
                    for start, end in record_format.stage_ranges(head, layers):
                        pipe.getrange(routes_key(sample_id), start, end - 1)
                    pipe.hget(record_key(sample_id), "gen")
            replies = iter(pipe.execute())
        records = []
        for head in heads:
            if not isinstance(head, record_format.Head):
                records.append(head)  # None, or a record in an older format, read whole
                continue
            ranges = [next(replies) for _ in record_format.stage_ranges(head, layers)]
            gen = next(replies)
            records.append(record_format.stage_record(head, layers, ranges, gen))
        return records

    def stat(self, sample_id: str) -> RecordStat:
        """Everything but the payload: geometry, counts, turns, size and time to live."""
        key = record_key(sample_id)
        with domain_errors_from_redis():
            pipe = self.client.pipeline(transaction=False)
            pipe.hgetall(key)
            pipe.memory_usage(key, samples=0)
            pipe.memory_usage(routes_key(sample_id), samples=0)
            pipe.pttl(key)
            fields, usage, routes_usage, ttl = pipe.execute()
        if fields.get(b"geometry") is None:
            raise NotFound(f"no record for sample_id {sample_id!r}")
        stored = int(usage or 0) + int(routes_usage or 0)
        return record_format.stat_record(sample_id, fields, stored, int(ttl))

    def expire_within(self, sample_ids: Sequence[str], ms: int) -> None:
        """Each record expires at most ``ms`` from now (``PEXPIRE LT``: never lengthened;
        unknown ids are left alone). One round trip."""
        with domain_errors_from_redis():
            pipe = self.client.pipeline(transaction=False)
            for sample_id in sample_ids:
                pipe.pexpire(record_key(sample_id), ms, lt=True)
                pipe.pexpire(routes_key(sample_id), ms, lt=True)
            pipe.execute()

    def delete(self, sample_id: str) -> None:
        with domain_errors_from_redis():
            if not self.client.delete(record_key(sample_id), routes_key(sample_id)):
                raise NotFound(f"no record for sample_id {sample_id!r}")


_SHAS = {source: hashlib.sha1(source.encode()).hexdigest() for source in (_COMMIT, _APPEND)}


def _evalsha(pipe, source: str, keys: list[str], args: list) -> None:
    """Queue the script by its hash (a script registered on a pipeline asks Redis whether it
    knows it on every execute: one more round trip)."""
    pipe.evalsha(_SHAS[source], len(keys), *keys, *args)
