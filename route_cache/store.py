"""Records in Redis or Redis Cluster, through one code path.

Layout (storage format 3): a record is TWO keys in one slot (``{<sample_id>}`` is the Cluster
hash tag of both), committed together, expiring together:

``rr:{<sample_id>}``, a hash of the small fields:

    geometry        JSON of the geometry (and the storage format version)
    group           the group id
    rows, tokens    row and token counts (rows == tokens - 1)
    bytes           the length of the routes value (every block's route bytes)
    gen             a random id given at commit: a read checks that both keys were this
                    record's when it read them
    b@<row_start>   JSON descriptor of the block written at that row (turns, each layer
                    part's size and checksum, the tokens' checksum)
    t@<row_start>   its token ids (int32 LE) then its turns' log-probs (float32 LE)

``rr:{<sample_id>}:routes``, a string: every block's routes in row order, each block
layer-major (its MoE layers' parts back to back: raw ``[rows, k]`` ids, or one zstd frame per
layer; ``codec.LayerParts``). A block's place is the sum of the blocks before it; a layer
range of a block is one byte range.

So a write is one SET of the routes (into a staging key) and a small commit script, in one
round trip; a whole read one GET of the routes and one HGETALL of the small fields; a read of
a layer range (a pipeline stage) one GETRANGE per block, after the small fields (two round
trips per window of records, the second overlapping the sending of the previous window).
Each layer part keeps its own xxh3-64 checksum, verified by the reader.

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
import json
import secrets
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np
import redis
import redis.cluster
import xxhash

from route_cache.connection import (
    WAIT_TIMEOUT_MS,
    domain_errors_from_redis,
    is_connection_error,
    replicated,
)
from routereplay.domain.codec import (
    EncodedRoutes,
    Encoding,
    LayerParts,
    contiguous,
    split_layers,
)
from routereplay.domain.record import Geometry, Turn, check_layer_selection
from routereplay.errors import (
    AlreadyExists,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    Unavailable,
)

FORMAT_VERSION = 3
# One hash per record, a field per MoE layer per block: read whole or by layer selection.
HASH_FORMAT_VERSION = 2
# One hash per record, one route field per block: read whole only.
OLD_FORMAT_VERSION = 1
LEGACY_FORMATS = (OLD_FORMAT_VERSION, HASH_FORMAT_VERSION)

# KEYS: record, routes, staging. ARGV: geometry JSON, group, block field, block descriptor,
# tokens field, tokens, rows, ttl, gen. The small fields go first: HSET is the only command
# Redis may refuse at its memory limit, and then nothing has changed.
_COMMIT = """
if redis.call('EXISTS', KEYS[3]) == 0 then return -2 end
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('DEL', KEYS[3])
  if redis.call('HGET', KEYS[1], 'geometry') == ARGV[1]
      and redis.call('HGET', KEYS[1], 'group') == ARGV[2]
      and redis.call('HGET', KEYS[1], ARGV[3]) == ARGV[4] then
    return 1
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
return 0
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

# Times a read starts again when another record was committed under its id while it read
# (a delete and a new write between its two ends: gen changed).
_READ_ATTEMPTS = 3


@dataclass
class StoredBlock:
    """Rows ``[row_start, row_start + routes.num_rows)`` and the tokens that came with them:
    ``token_ids`` int32 ``[N]`` are tokens ``[token_start, token_start + N)`` of the record."""

    row_start: int
    token_start: int
    token_ids: np.ndarray
    turns: list[Turn]
    # Written: either form (the store splits a whole block into layers). Read: LayerParts of
    # the selected layers, or EncodedRoutes for a record in storage format 1.
    routes: EncodedRoutes | LayerParts
    # Written LayerParts: their bytes back to back when the caller holds them so (a received
    # layer-major block), which the store then sends to Redis without joining them again.
    data: bytes | memoryview | None = None


@dataclass
class StoredRecord:
    """A record as read; ``layers``: the MoE layer selection it was read with (None: all)."""

    sample_id: str
    group_id: str
    geometry: Geometry
    blocks: list[StoredBlock] = field(default_factory=list)
    format: int = FORMAT_VERSION
    layers: tuple[int, ...] | None = None

    @property
    def num_rows(self) -> int:
        return sum(b.routes.num_rows for b in self.blocks)

    @property
    def token_ids(self) -> np.ndarray:
        return np.concatenate([b.token_ids for b in self.blocks])

    @property
    def turns(self) -> list[Turn]:
        return [t for b in self.blocks for t in b.turns]


@dataclass
class RecordStat:
    """A record without its payload, and what it takes in Redis.

    Attributes:
        record: Its blocks carry no token ids, log-probs or route bytes.
        num_tokens: Tokens of the record.
        stored_bytes: Redis's own count for the whole key (``MEMORY USAGE``): route, token and
            log-prob bytes, descriptors, field names and the hash's overhead.
        ttl_ms: Until it expires; -1 when it never does.
        block_sizes: Per block (``record.blocks`` order), the bytes of each stored route part
            as encoded: one per MoE layer (storage formats 3 and 2), or one for the whole
            block (format 1).
    """

    record: StoredRecord
    num_tokens: int
    stored_bytes: int
    ttl_ms: int
    block_sizes: list[tuple[int, ...]] = field(default_factory=list)

    @property
    def route_bytes(self) -> int:
        """The record's route bytes as stored (encoded: RAW ids, or zstd frames)."""
        return sum(sum(sizes) for sizes in self.block_sizes)


def record_key(sample_id: str) -> str:
    return f"rr:{{{sample_id}}}"


def routes_key(sample_id: str) -> str:
    """The string of the record's route bytes (storage format 3), in its record's slot."""
    return f"rr:{{{sample_id}}}:routes"


def settled_key(sample_id: str) -> str:
    """The hash of which ready-feed entry settled the sample, per consumer group (beside its
    record, in its slot; see ``ReadyFeed.ack``)."""
    return f"rr:{{{sample_id}}}:settled"


class RouteStore:
    """Reads and writes records; see the module docstring for the layout.

    Args:
        client: a ``redis.Redis`` or ``redis.cluster.RedisCluster`` (passed in, never global).
        ttl_ms: records expire this long after their last write; 0 keeps them.
        batch_window: records fetched per pipeline round trip in ``read_many``. One by
            default: the next record is fetched while this one is sent, so Redis and gRPC
            overlap; measured on batch reads of 4K- and 32K-token Qwen3-30B-A3B records, 1 is
            1.2-3x faster than 8, which fetches a whole batch of 4-8 records before sending.
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
        batch_window: int = 1,
        wait_replicas: int = 0,
        wait_timeout_ms: int = WAIT_TIMEOUT_MS,
        stage_window: int = 8,
    ):
        self.client = client
        self.stage_window = stage_window
        self.ttl_ms = ttl_ms
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

    def write(self, sample_id: str, group_id: str, geometry: Geometry, block: StoredBlock) -> bool:
        """Store a new record made of ``block``. Returns True when an identical record was
        already stored (a retry).

        Raises:
            AlreadyExists: a different record has this id.
        """
        desc, tokens, value = _block_fields(block, geometry)
        key, geometry_json = record_key(sample_id), _geometry_json(geometry)
        staging = f"{key}:stage:{secrets.token_hex(8)}"
        keys = [key, routes_key(sample_id), staging]
        args = [
            geometry_json,
            group_id,
            f"b@{block.row_start}",
            desc,
            f"t@{block.row_start}",
            tokens,
            block.routes.num_rows,
            self.ttl_ms,
            secrets.token_hex(8),
        ]

        def queue(pipe):
            # The routes go as the value of a plain SET, born with the staging expiry: Redis
            # takes a megabyte argument there without copying it again (a script argument
            # is copied three times; one inside a MULTI is queued first).
            pipe.set(staging, value, px=STAGING_TTL_MS)
            _evalsha(pipe, _COMMIT, keys, args)

        result = self._run(key, queue)[-1]
        if result == -2:
            raise Unavailable(f"the staged record of {sample_id!r} vanished before its commit")
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
        desc, tokens, value = _block_fields(block, geometry)
        offset = block.row_start
        key = record_key(sample_id)
        keys = [key, routes_key(sample_id)]
        args = [
            _geometry_json(geometry),
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
        version = json.loads(stored).get("format") if stored is not None else None
        if version in LEGACY_FORMATS:
            raise FailedPrecondition(old_format_message(sample_id, what, version))

    def read(self, sample_id: str, layers: tuple[int, ...] | None = None) -> StoredRecord:
        record = next(self.read_many([sample_id], layers))
        if record is None:
            raise NotFound(f"no record for sample_id {sample_id!r}")
        return record

    def read_many(
        self, sample_ids: Sequence[str], layers: tuple[int, ...] | None = None
    ) -> Iterator[StoredRecord | None]:
        """Records in the order asked (None for unknown ids), ``batch_window`` per fetch (one
        round trip, two with ``layers``), so a large batch streams instead of sitting in
        memory whole. The next window is fetched while the caller consumes this one.

        Args:
            layers: MoE layer indices (checked ascending by the caller): only their route
                bytes are fetched from Redis (one range per run of consecutive layers per
                block). None: every layer.

        Raises:
            InvalidArgument: ``layers`` reaches beyond a record's geometry.
            FailedPrecondition: ``layers`` given for a record in storage format 1.
        """
        # A stage read fetches more records per round trip: it takes two, and moves a
        # fraction of each record's bytes.
        size = self.batch_window if layers is None else self.stage_window
        windows = [sample_ids[start : start + size] for start in range(0, len(sample_ids), size)]
        with ThreadPoolExecutor(max_workers=1) as prefetch:
            pending = prefetch.submit(self._fetch, windows[0], layers) if windows else None
            for i in range(len(windows)):
                records = pending.result()
                if i + 1 < len(windows):
                    pending = prefetch.submit(self._fetch, windows[i + 1], layers)
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
                if record is _CHANGED:
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
                _whole_record(sample_id, *replies[3 * i : 3 * i + 3])
                for i, sample_id in enumerate(window)
            ]
        # A stage: the small fields first, then one range per run of layers per block.
        heads = [
            _head(sample_id, fields, layers)
            for sample_id, fields in zip(window, replies, strict=True)
        ]
        with domain_errors_from_redis():
            pipe = self.client.pipeline(transaction=False)
            for sample_id, head in zip(window, heads, strict=True):
                if isinstance(head, _Head):
                    for start, end in _stage_ranges(head, layers):
                        pipe.getrange(routes_key(sample_id), start, end - 1)
                    pipe.hget(record_key(sample_id), "gen")
            replies = iter(pipe.execute())
        records = []
        for head in heads:
            if not isinstance(head, _Head):
                records.append(head)  # None, or a record in an older format, read whole
                continue
            ranges = [next(replies) for _ in _stage_ranges(head, layers)]
            gen = next(replies)
            records.append(_stage_record(head, layers, ranges, gen))
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
        version = json.loads(fields[b"geometry"]).get("format")
        if version in LEGACY_FORMATS:
            return _legacy_stat(sample_id, fields, int(usage or 0), int(ttl))
        head = _parse_head(sample_id, fields, payload=False)
        record, block_sizes = head.record, head.sizes
        stored = int(usage or 0) + int(routes_usage or 0)
        return RecordStat(record, int(fields[b"tokens"]), stored, int(ttl), block_sizes)

    def delete(self, sample_id: str) -> None:
        with domain_errors_from_redis():
            if not self.client.delete(record_key(sample_id), routes_key(sample_id)):
                raise NotFound(f"no record for sample_id {sample_id!r}")
            # A record written again under this id is announced again, and trained anew.
            self.client.delete(settled_key(sample_id))


def _geometry_json(geometry: Geometry) -> str:
    return json.dumps(
        {
            "format": FORMAT_VERSION,
            "moe_layers": list(geometry.moe_layers),
            "topk": geometry.topk,
            "num_experts": geometry.num_experts,
            "model_id": geometry.model_id,
        },
        sort_keys=True,
        separators=(",", ":"),
    )


def old_format_message(sample_id: str, what: str, version: int = OLD_FORMAT_VERSION) -> str:
    layout = {
        OLD_FORMAT_VERSION: "one hash, one route field per block",
        HASH_FORMAT_VERSION: "one hash, one route field per MoE layer per block",
    }[version]
    return (
        f"record {sample_id!r} is in storage format {version} ({layout}, written by an "
        f"earlier release): it can be read but not {what}; it expires after the route "
        "cache's --ttl-s, or read it whole, delete it and write it again"
    )


_SHAS = {source: hashlib.sha1(source.encode()).hexdigest() for source in (_COMMIT, _APPEND)}


def _evalsha(pipe, source: str, keys: list[str], args: list) -> None:
    """Queue the script by its hash (a script registered on a pipeline asks Redis whether it
    knows it on every execute: one more round trip)."""
    pipe.evalsha(_SHAS[source], len(keys), *keys, *args)


class _Changed:
    """A read that found another record committed under its id while it read."""


_CHANGED = _Changed()


def _block_fields(block: StoredBlock, geometry: Geometry) -> tuple[str, bytes, bytes | memoryview]:
    """The block's descriptor (JSON), its token/log-prob bytes and its route bytes as stored
    (layer-major: every MoE layer's part back to back)."""
    tokens = np.asarray(block.token_ids, "<i4").tobytes() + b"".join(
        np.asarray(t.logprobs, "<f4").tobytes() for t in block.turns
    )
    parts = block.routes
    if isinstance(parts, EncodedRoutes):
        parts = split_layers(parts, geometry)
    value = block.data if block.data is not None else contiguous(parts)
    desc = {
        "row_start": block.row_start,
        "num_rows": parts.num_rows,
        "token_start": block.token_start,
        "num_tokens": int(block.token_ids.size),
        "encoding": parts.encoding.value,
        "parts": [[len(p), c] for p, c in zip(parts.parts, parts.checksums, strict=True)],
        "tokens_checksum": xxhash.xxh3_64_intdigest(tokens),
        "turns": [
            [t.token_start, t.token_end, t.generated_start, t.policy_version, t.logprobs.size]
            for t in block.turns
        ],
    }
    return json.dumps(desc, separators=(",", ":")), tokens, value


@dataclass
class _Head:
    """A format-3 record's small fields: the record with its blocks' part sizes and
    checksums (no route bytes yet), where each block starts in the routes value, and the
    record's ``gen``."""

    record: StoredRecord
    offsets: list[int]
    sizes: list[tuple[int, ...]]
    gen: bytes | None
    ranges: dict = field(default_factory=dict)


def _geometry_of(fields: dict) -> tuple[Geometry, int]:
    geometry = json.loads(fields[b"geometry"])
    return (
        Geometry(
            tuple(geometry["moe_layers"]),
            geometry["topk"],
            geometry["num_experts"],
            geometry["model_id"],
        ),
        geometry.get("format"),
    )


def _parse_head(sample_id: str, fields: dict, payload: bool = True) -> _Head:
    """The record in a format-3 hash, its routes as LayerParts of every layer whose parts
    are empty (the sizes and checksums are the descriptor's)."""
    geometry, _ = _geometry_of(fields)
    record = StoredRecord(sample_id, fields[b"group"].decode(), geometry)
    layers = tuple(range(geometry.num_moe_layers))
    offsets, all_sizes, offset = [], [], 0
    for row_start in sorted(int(name[2:]) for name in fields if name.startswith(b"b@")):
        desc = json.loads(fields[b"b@%d" % row_start])
        token_ids, turns = _tokens_and_turns(sample_id, fields, row_start, desc, payload)
        sizes = tuple(size for size, _ in desc["parts"])
        routes = LayerParts(
            Encoding(desc["encoding"]),
            desc["num_rows"],
            layers,
            tuple(b"" for _ in sizes),
            tuple(c for _, c in desc["parts"]),
        )
        record.blocks.append(StoredBlock(row_start, desc["token_start"], token_ids, turns, routes))
        offsets.append(offset)
        all_sizes.append(sizes)
        offset += sum(sizes)
    return _Head(record, offsets, all_sizes, fields.get(b"gen"))


def _tokens_and_turns(
    sample_id: str, fields: dict, row_start: int, desc: dict, payload: bool
) -> tuple[np.ndarray, list[Turn]]:
    turns = [Turn(ts, te, gs, pv) for ts, te, gs, pv, _ in desc["turns"]]
    if not payload:
        return np.zeros(0, np.int32), turns
    tokens = fields[b"t@%d" % row_start]
    if xxhash.xxh3_64_intdigest(tokens) != desc["tokens_checksum"]:
        raise DataLoss(f"record {sample_id!r}: token bytes of block {row_start} corrupt")
    n_tokens = desc["num_tokens"]
    token_ids = np.frombuffer(tokens, "<i4", count=n_tokens)
    offset = 4 * n_tokens
    for turn, (*_, n_logprobs) in zip(turns, desc["turns"], strict=True):
        turn.logprobs = np.frombuffer(tokens, "<f4", count=n_logprobs, offset=offset)
        offset += 4 * n_logprobs
    return token_ids, turns


def _part_views(sizes: tuple[int, ...], data: memoryview) -> tuple[memoryview, ...]:
    """Parts of ``sizes`` cut from ``data``, their bytes back to back."""
    views, offset = [], 0
    for size in sizes:
        views.append(data[offset : offset + size])
        offset += size
    return tuple(views)


def _whole_record(sample_id: str, gen, value, fields: dict):
    """The record a whole read found: ``gen`` before, the routes value, the small fields
    after. None when there is none (or it expired meanwhile); ``_CHANGED`` when another
    record was committed under the id while it was read."""
    if not fields or fields.get(b"geometry") is None:
        return None
    _, version = _geometry_of(fields)
    if version in LEGACY_FORMATS:
        return _parse_legacy(sample_id, fields)
    if gen != fields.get(b"gen"):
        return _CHANGED
    if value is None:  # expired a moment before the small fields
        return None
    head = _parse_head(sample_id, fields)
    view, blocks = memoryview(value), []
    for block, offset, sizes in zip(head.record.blocks, head.offsets, head.sizes, strict=True):
        end = offset + sum(sizes)
        if end > len(view):  # appended after the routes were read: not in this read
            break
        block.routes = replace(block.routes, parts=_part_views(sizes, view[offset:end]))
        blocks.append(block)
    held = sum(sum(b.routes.sizes) for b in blocks)
    if held != len(view):
        raise DataLoss(
            f"record {sample_id!r}: its routes hold {len(view)} bytes; its blocks describe {held}"
        )
    head.record.blocks = blocks
    return head.record


def _head(sample_id: str, fields: dict, layers: tuple[int, ...]):
    """A stage read's first step: the record's small fields (None: no record). A record in
    an older format comes back whole from this step, its selection taken from it."""
    if not fields or fields.get(b"geometry") is None:
        return None
    geometry, version = _geometry_of(fields)
    if version in LEGACY_FORMATS:
        return _parse_legacy(sample_id, fields, layers=layers)
    check_layer_selection(layers, geometry.num_moe_layers, "layers.indices")
    return _parse_head(sample_id, fields)


def _runs(layers: tuple[int, ...]) -> list[tuple[int, int]]:
    """Runs of consecutive layer indices, as ``[first, last + 1)``."""
    runs = []
    for layer in layers:
        if runs and runs[-1][1] == layer:
            runs[-1][1] = layer + 1
        else:
            runs.append([layer, layer + 1])
    return [tuple(run) for run in runs]


def _stage_ranges(head: _Head, layers: tuple[int, ...]) -> list[tuple[int, int]]:
    """The byte ranges ``[start, end)`` of the routes value a selection reads: one per run of
    consecutive layers per block (empty ones left out: GETRANGE cannot ask for nothing)."""
    if layers not in head.ranges:
        ranges = []
        for offset, sizes in zip(head.offsets, head.sizes, strict=True):
            starts = np.cumsum((0, *sizes)).tolist()
            for first, stop in _runs(layers):
                start, end = offset + starts[first], offset + starts[stop]
                if end > start:
                    ranges.append((start, end))
        head.ranges[layers] = ranges
    return head.ranges[layers]


def _stage_record(head: _Head, layers: tuple[int, ...], ranges: list[bytes], gen):
    """A stage read's record from its ranges; None when it went away meanwhile,
    ``_CHANGED`` when another record was committed under its id."""
    if gen != head.gen:
        return None if gen is None else _CHANGED
    expected = _stage_ranges(head, layers)
    if any(len(got) != end - start for got, (start, end) in zip(ranges, expected, strict=True)):
        return None  # the routes expired a moment before the small fields
    got = iter(ranges)
    record = head.record
    record.layers = layers
    for block, sizes in zip(record.blocks, head.sizes, strict=True):
        parts = []
        for first, stop in _runs(layers):
            size = sum(sizes[first:stop])
            view = memoryview(next(got)) if size else memoryview(b"")
            offset = 0
            for j in range(first, stop):
                parts.append(view[offset : offset + sizes[j]])
                offset += sizes[j]
        checksums = tuple(block.routes.checksums[j] for j in layers)
        block.routes = LayerParts(
            block.routes.encoding, block.routes.num_rows, layers, tuple(parts), checksums
        )
    return record


def _legacy_stat(sample_id: str, fields: dict, usage: int, ttl: int) -> RecordStat:
    """StatRecord of a record in storage format 1 or 2 (one hash, fetched whole)."""
    record = _parse_legacy(sample_id, fields, payload=False)
    block_sizes = []
    for block in record.blocks:
        if record.format == OLD_FORMAT_VERSION:
            block_sizes.append((len(fields.get(b"r@%d" % block.row_start, b"")),))
        else:
            names = [b"r@%d:%d" % (block.row_start, j) for j in block.routes.layers]
            block_sizes.append(tuple(len(fields.get(name, b"")) for name in names))
    return RecordStat(record, int(fields[b"tokens"]), usage, ttl, block_sizes)


def _parse_legacy(
    sample_id: str, fields: dict, payload: bool = True, layers: tuple[int, ...] | None = None
) -> StoredRecord:
    """The record in ``fields`` (a hash's fields; with ``layers``, only those layers' route
    parts among them)."""
    geometry = json.loads(fields[b"geometry"])
    version = geometry.get("format")
    if version not in LEGACY_FORMATS:
        raise DataLoss(f"record {sample_id!r} has storage format {version}")
    if layers is not None and version == OLD_FORMAT_VERSION:
        raise FailedPrecondition(old_format_message(sample_id, "read by layer selection"))
    record = StoredRecord(
        sample_id,
        fields[b"group"].decode(),
        Geometry(
            tuple(geometry["moe_layers"]),
            geometry["topk"],
            geometry["num_experts"],
            geometry["model_id"],
        ),
        format=version,
        layers=layers,
    )
    if layers is not None:
        check_layer_selection(layers, record.geometry.num_moe_layers, "layers.indices")
    selected = layers or tuple(range(record.geometry.num_moe_layers))
    starts = sorted(int(name[2:]) for name in fields if name.startswith(b"b@"))
    for row_start in starts:
        desc = json.loads(fields[b"b@%d" % row_start])
        n_tokens = desc["num_tokens"]
        turns = [Turn(ts, te, gs, pv) for ts, te, gs, pv, _ in desc["turns"]]
        token_ids = np.zeros(0, np.int32)
        data = b""
        if payload:
            tokens = fields[b"t@%d" % row_start]
            if xxhash.xxh3_64_intdigest(tokens) != desc["tokens_checksum"]:
                raise DataLoss(f"record {sample_id!r}: token bytes of block {row_start} corrupt")
            token_ids = np.frombuffer(tokens, "<i4", count=n_tokens)
            offset = 4 * n_tokens
            for turn, (*_, n_logprobs) in zip(turns, desc["turns"], strict=True):
                turn.logprobs = np.frombuffer(tokens, "<f4", count=n_logprobs, offset=offset)
                offset += 4 * n_logprobs
        encoding, rows = Encoding(desc["encoding"]), desc["num_rows"]
        if version == OLD_FORMAT_VERSION:
            data = fields[b"r@%d" % row_start] if payload else b""
            routes = EncodedRoutes(encoding, data, desc["checksum"], rows)
        else:
            parts = tuple(
                fields.get(b"r@%d:%d" % (row_start, j), b"") if payload else b"" for j in selected
            )
            checksums = tuple(desc["parts"][j][1] for j in selected)
            routes = LayerParts(encoding, rows, selected, parts, checksums)
        record.blocks.append(StoredBlock(row_start, desc["token_start"], token_ids, turns, routes))
    return record
