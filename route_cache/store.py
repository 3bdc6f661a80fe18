"""Records in Redis or Redis Cluster, through one code path.

Layout: a record is ONE hash key, ``rr:{<sample_id>}`` (the braces are a Cluster hash tag), so
it lives in one slot, commits atomically, expires as a unit and reads whole in one round trip:

    geometry        JSON of the geometry (and the storage format version)
    group           the group id
    rows, tokens    row and token counts (rows == tokens - 1)
    b@<row_start>   JSON descriptor of the block written at that row (turns, checksums)
    t@<row_start>   its token ids (int32 LE) then its turns' log-probs (float32 LE)
    r@<row_start>:<j>  its routes of MoE layer index j (``codec.LayerParts``: raw
                    ``[rows, k]`` or one zstd frame), each with its checksum in b@<row_start>

Per-layer fields let a read of a layer selection fetch and send only those layers' bytes:
HKEYS, then one HMGET of the fields it needs (a Lua script that picks the fields inside Redis
copies the values twice more: 5.1 against 0.8 ms for a quarter of a 12 MB record). Committed
fields never change, so the two steps see a consistent record: an append in between adds
blocks the read leaves out, a delete in between reads as no record.

Storage format 1 (before per-layer fields) kept one field ``r@<row_start>`` of the whole
block: such records are still read whole, and refused for a layer selection or an append
(FailedPrecondition: they expire after their TTL, or are deleted and written again).

A new record is first written whole into a staging hash ``rr:{<sample_id>}:stage:<random>``
(created with a short expiry by one MULTI, then given the payload), then committed by a small Lua
script that RENAMEs it into place when the id is free: a reader sees a record whole or not at
all, and a staging hash left by a crashed writer expires on its own. (Passing the routes as
script arguments instead costs three copies of them inside Redis: measured 4.4 ms against 1.5
ms for a plain HSET of a 1.5 MB block.) An append runs as one Lua script that checks the row
count it expects in the same step that applies it.

With ``wait_replicas`` set, a write or append is acknowledged only once Redis ``WAIT`` reports
that many replicas hold it (sent on the connection that made the write, to the key's master);
fewer within ``wait_timeout_ms`` raise Unavailable, and the caller's retry finds the record
stored (a duplicate) or writes it again. This is not strong consistency: the write stays on the
master if WAIT falls short, and a replica that has a write in memory can still lose it (a
failover can promote another replica, or a replica can restart without persistence). It closes
the window in which a master is killed between its reply and asynchronous replication.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import redis
import redis.cluster
import xxhash
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from routereplay.domain.codec import EncodedRoutes, Encoding, LayerParts, split_layers
from routereplay.domain.record import Geometry, Turn, check_layer_selection
from routereplay.errors import (
    AlreadyExists,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    Unavailable,
)

FORMAT_VERSION = 2
# Whole-block route fields: still read whole, not selectable or appendable.
OLD_FORMAT_VERSION = 1

# KEYS: record, staging hash. ARGV: geometry JSON, group, block field, block descriptor, ttl.
_COMMIT = """
if redis.call('EXISTS', KEYS[2]) == 0 then return -2 end
if redis.call('EXISTS', KEYS[1]) == 1 then
  redis.call('DEL', KEYS[2])
  if redis.call('HGET', KEYS[1], 'geometry') == ARGV[1]
      and redis.call('HGET', KEYS[1], 'group') == ARGV[2]
      and redis.call('HGET', KEYS[1], ARGV[3]) == ARGV[4] then
    return 1
  end
  return -1
end
redis.call('RENAME', KEYS[2], KEYS[1])
if tonumber(ARGV[5]) > 0 then
  redis.call('PEXPIRE', KEYS[1], ARGV[5])
else
  redis.call('PERSIST', KEYS[1])
end
return 0
"""

STAGING_TTL_MS = 600_000
WAIT_TIMEOUT_MS = 2_000

# KEYS: record. ARGV: geometry JSON, row offset, rows added, ttl, descriptor field, descriptor,
# then the block's other fields as name, value pairs (tokens, one per MoE layer).
_APPEND = """
local rows = redis.call('HGET', KEYS[1], 'rows')
if not rows then return {-2, 0} end
if redis.call('HGET', KEYS[1], 'geometry') ~= ARGV[1] then return {-3, 0} end
rows = tonumber(rows)
local offset = tonumber(ARGV[2])
if offset == rows then
  local added = tonumber(ARGV[3])
  redis.call('HSET', KEYS[1], 'rows', rows + added, 'tokens', rows + added + 1,
             ARGV[5], ARGV[6], unpack(ARGV, 7))
  if tonumber(ARGV[4]) > 0 then redis.call('PEXPIRE', KEYS[1], ARGV[4]) end
  return {0, rows + added}
end
if offset < rows and redis.call('HGET', KEYS[1], ARGV[5]) == ARGV[6] then
  return {1, rows}
end
return {-1, rows}
"""

# What redis-py raises when the server cannot be reached or a cluster is failing over
# (MOVED and READONLY reach us only on a single node's connection, used for WAIT).
CONNECTION_ERRORS = (
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    redis.exceptions.ClusterDownError,
    redis.exceptions.TryAgainError,
    redis.exceptions.MasterDownError,
    redis.exceptions.AskError,
    redis.exceptions.ReadOnlyError,
)


def is_connection_error(exc: BaseException) -> bool:
    """Whether ``exc`` says Redis cannot be reached (not that a command is wrong). A cluster
    client with no reachable node raises the generic ``RedisClusterException``, which also
    reports mistakes; only one caused by a connection failure counts."""
    if isinstance(exc, CONNECTION_ERRORS):
        return True
    return isinstance(exc, redis.exceptions.RedisClusterException) and isinstance(
        exc.__cause__, CONNECTION_ERRORS
    )


@dataclass
class StoredBlock:
    """Rows ``[row_start, row_start + routes.num_rows)`` and the tokens that came with them:
    ``token_ids`` int32 ``[N]`` are tokens ``[token_start, token_start + N)`` of the record."""

    row_start: int
    token_start: int
    token_ids: np.ndarray
    turns: list[Turn]
    # Written: either form (the store splits a whole block into layers). Read: LayerParts of
    # the selected layers, or EncodedRoutes for a record in the old storage format.
    routes: EncodedRoutes | LayerParts


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
        block_sizes: Per block (``record.blocks`` order), the bytes of each stored route field
            as encoded: one per MoE layer (storage format 2), or one for the whole block
            (format 1).
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


def settled_key(sample_id: str) -> str:
    """The hash of which ready-feed entry settled the sample, per consumer group (beside its
    record, in its slot; see ``ReadyFeed.ack``)."""
    return f"rr:{{{sample_id}}}:settled"


# Records are megabytes: redis-py's default 64 KiB socket reads cost about a tenth of a batch
# read (GETs of 12 MiB values: 699 MiB/s at 64 KiB, 773 at 256 KiB, 813 at 1 MiB, one run).
SOCKET_READ_BYTES = 256 * 1024


# How a cluster client retries a command (after reading the slot map again) when a node cannot
# be reached. redis-py's default pauses up to 1 s between its 10 retries, so a write through
# a MULTI that began during a failover went on 1-2 s after the promotion (3.8 s in all,
# measured): pauses of at most 0.1 s find the new master within 0.1 s, and the 10 retries
# end within about 0.8 s, after which the writer's own retry policy takes over.
CLUSTER_RETRY_CAP_S = 0.1


def connect(url: str, cluster: bool, **kwargs) -> redis.Redis | redis.cluster.RedisCluster:
    """A redis-py client for a single server or a cluster; the rest of the code is the same."""
    kwargs.setdefault("socket_read_size", SOCKET_READ_BYTES)
    if cluster:
        kwargs.setdefault(
            "retry",
            Retry(ExponentialWithJitterBackoff(base=0.01, cap=CLUSTER_RETRY_CAP_S), retries=10),
        )
        return redis.cluster.RedisCluster.from_url(url, **kwargs)
    return redis.Redis.from_url(url, **kwargs)


def replicated(client, key: str, queue, replicas: int, timeout_ms: int) -> tuple[list, int]:
    """Run the commands ``queue(pipe)`` puts on a pipeline (all on ``key``'s slot), then
    ``WAIT replicas timeout_ms``, in one round trip on one connection to ``key``'s master
    (WAIT counts the replicas that hold that connection's own writes).

    In a cluster that connection is the master's own, which does not follow a failover as the
    cluster client's commands do: when it fails (the old master is down, or answers MOVED as
    a replica), the slot map is read again, and the command runs once more at once if the key
    has another master now (callers' commands are safe to run twice). Without that, appends
    went on to the old master until some other command happened to refresh the map.

    Returns:
        (the commands' results, how many replicas confirmed them).
    """
    if not isinstance(client, redis.cluster.RedisCluster):
        return _run_and_wait(client, queue, replicas, timeout_ms)
    node = client.get_node_from_key(key)
    try:
        return _run_and_wait(client.get_redis_connection(node), queue, replicas, timeout_ms)
    except redis.exceptions.MovedError as exc:  # the slot's master is the one it names
        client.nodes_manager.move_slot(exc)
        moved_to = client.get_node_from_key(key)
    except CONNECTION_ERRORS:
        client.nodes_manager.initialize()
        moved_to = client.get_node_from_key(key)
        if moved_to.name == node.name:
            raise
    return _run_and_wait(client.get_redis_connection(moved_to), queue, replicas, timeout_ms)


def _run_and_wait(node: redis.Redis, queue, replicas: int, timeout_ms: int) -> tuple[list, int]:
    with node.pipeline(transaction=False) as pipe:
        queue(pipe)
        pipe.execute_command("WAIT", replicas, timeout_ms)
        *results, confirmed = pipe.execute()
    return results, int(confirmed)


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
    """

    def __init__(
        self,
        client,
        ttl_ms: int = 0,
        batch_window: int = 1,
        wait_replicas: int = 0,
        wait_timeout_ms: int = WAIT_TIMEOUT_MS,
    ):
        self.client = client
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
        desc, payload = _block_fields(block, geometry)
        rows = block.routes.num_rows
        key, geometry_json = record_key(sample_id), _geometry_json(geometry)
        staging = f"{key}:stage:{secrets.token_hex(8)}"
        header = {
            "geometry": geometry_json,
            "group": group_id,
            "rows": rows,
            "tokens": rows + 1,
            f"b@{block.row_start}": desc,
        }
        with domain_errors_from_redis():
            # The staging hash is born with its expiry (one MULTI of its small fields); the
            # payload follows outside the MULTI, where Redis takes megabyte arguments without
            # queueing them (12 MB: 4.9 ms against 9.4 inside a MULTI).
            with self.client.pipeline(transaction=True) as pipe:
                pipe.hset(staging, mapping=header)
                pipe.pexpire(staging, STAGING_TTL_MS)
                pipe.execute()
            self.client.hset(staging, mapping=payload)
            result = self._replicated(
                self._commit,
                keys=[key, staging],
                args=[geometry_json, group_id, f"b@{block.row_start}", desc, self.ttl_ms],
            )
        if result == -2:
            raise Unavailable(f"the staged record of {sample_id!r} vanished before its commit")
        if result == -1:
            raise AlreadyExists(f"sample_id {sample_id!r} already holds a different record")
        return result == 1

    def append(self, sample_id: str, geometry: Geometry, block: StoredBlock) -> tuple[bool, int]:
        """Append ``block`` at ``block.row_start``, which must equal the stored row count.

        Returns:
            (duplicate, rows): duplicate is True when this very block was already appended.

        Raises:
            NotFound, InvalidArgument (geometry differs), FailedPrecondition (stale offset).
        """
        desc, payload = _block_fields(block, geometry)
        offset = block.row_start
        pairs = [item for name_value in payload.items() for item in name_value]
        with domain_errors_from_redis():
            status, rows = self._replicated(
                self._append,
                keys=[record_key(sample_id)],
                args=[
                    _geometry_json(geometry),
                    offset,
                    block.routes.num_rows,
                    self.ttl_ms,
                    f"b@{offset}",
                    desc,
                    *pairs,
                ],
            )
        if status == -2:
            raise NotFound(f"no record for sample_id {sample_id!r}")
        if status == -3:
            self._refuse_old_format(sample_id, "appended to")
            raise InvalidArgument(
                f"geometry differs from the stored record of {sample_id!r}: appends must keep it"
            )
        if status == -1:
            raise FailedPrecondition(
                f"append at row_offset {offset} refused: the record of {sample_id!r} has {rows} "
                "rows (a stale or out-of-order append)"
            )
        return status == 1, int(rows)

    def _replicated(self, script, keys: list[str], args: list):
        """Run ``script``; with ``wait_replicas``, confirmed by that many replicas.

        Raises:
            Unavailable: fewer replicas than ``wait_replicas`` confirmed in time.
        """
        if not self.wait_replicas:
            return script(keys=keys, args=args)
        (result,), replicas = replicated(
            self.client,
            keys[0],
            lambda pipe: script(keys=keys, args=args, client=pipe),
            self.wait_replicas,
            self.wait_timeout_ms,
        )
        if replicas < self.wait_replicas:
            raise Unavailable(
                f"{replicas} of {self.wait_replicas} replicas confirmed the write of {keys[0]} "
                f"within {self.wait_timeout_ms} ms"
            )
        return result

    def _refuse_old_format(self, sample_id: str, what: str) -> None:
        """Raise FailedPrecondition when the record is in the old storage format."""
        with domain_errors_from_redis():
            stored = self.client.hget(record_key(sample_id), "geometry")
        if stored is not None and json.loads(stored).get("format") == OLD_FORMAT_VERSION:
            raise FailedPrecondition(old_format_message(sample_id, what))

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
                parts are fetched from Redis. None: every layer.

        Raises:
            InvalidArgument: ``layers`` reaches beyond a record's geometry.
            FailedPrecondition: ``layers`` given for a record in the old storage format.
        """
        windows = [
            sample_ids[start : start + self.batch_window]
            for start in range(0, len(sample_ids), self.batch_window)
        ]
        with ThreadPoolExecutor(max_workers=1) as prefetch:
            pending = prefetch.submit(self._fetch, windows[0], layers) if windows else None
            for i, window in enumerate(windows):
                results = pending.result()
                if i + 1 < len(windows):
                    pending = prefetch.submit(self._fetch, windows[i + 1], layers)
                for sample_id, fields in zip(window, results, strict=True):
                    yield _parse_record(sample_id, fields, layers=layers) if fields else None

    def _fetch(self, window: Sequence[str], layers: tuple[int, ...] | None) -> list[dict]:
        """The fields of each record in ``window`` (``{}``: no record); with ``layers``, all
        but the route parts of other layers."""
        keys = [record_key(sample_id) for sample_id in window]
        with domain_errors_from_redis():
            pipe = self.client.pipeline(transaction=False)
            for key in keys:
                if layers is None:
                    pipe.hgetall(key)
                else:
                    pipe.hkeys(key)
            results = pipe.execute()
            if layers is None:
                return results
            wanted = [_selected_fields(names, layers) for names in results]
            pipe = self.client.pipeline(transaction=False)
            for key, names in zip(keys, wanted, strict=True):
                if names:
                    pipe.hmget(key, names)
            values = iter(pipe.execute())
        records = []
        for names in wanted:
            fields = {}
            if names:
                fields = {n: v for n, v in zip(names, next(values), strict=True) if v is not None}
            # Deleted between the two steps: HMGET answers nil for every field.
            records.append(fields if fields.get(b"geometry") is not None else {})
        return records

    def stat(self, sample_id: str) -> RecordStat:
        """Everything but the payload: geometry, counts, turns, size and time to live."""
        key = record_key(sample_id)
        with domain_errors_from_redis():
            names = self.client.hkeys(key)
            if not names:
                raise NotFound(f"no record for sample_id {sample_id!r}")
            wanted = [n for n in names if not n.startswith((b"t@", b"r@"))]
            routes = [n for n in names if n.startswith(b"r@")]
            pipe = self.client.pipeline(transaction=False)
            pipe.hmget(key, wanted)
            pipe.memory_usage(key, samples=0)
            pipe.pttl(key)
            for name in routes:  # the route fields' lengths, not their bytes
                pipe.hstrlen(key, name)
            values, usage, ttl, *lengths = pipe.execute()
        fields = dict(zip(wanted, values, strict=True))
        if fields.get(b"geometry") is None:  # deleted between the two calls
            raise NotFound(f"no record for sample_id {sample_id!r}")
        record = _parse_record(sample_id, fields, payload=False)
        size = dict(zip(routes, lengths, strict=True))
        block_sizes = []
        for block in record.blocks:
            if record.format == OLD_FORMAT_VERSION:
                block_sizes.append((int(size.get(b"r@%d" % block.row_start, 0)),))
            else:
                names = [b"r@%d:%d" % (block.row_start, j) for j in block.routes.layers]
                block_sizes.append(tuple(int(size.get(name, 0)) for name in names))
        return RecordStat(record, int(fields[b"tokens"]), int(usage or 0), int(ttl), block_sizes)

    def delete(self, sample_id: str) -> None:
        with domain_errors_from_redis():
            if not self.client.delete(record_key(sample_id)):
                raise NotFound(f"no record for sample_id {sample_id!r}")
            # A record written again under this id is announced again, and trained anew.
            self.client.delete(settled_key(sample_id))


class domain_errors_from_redis:
    """Turns redis-py's connection failures into Unavailable (gRPC UNAVAILABLE), and Redis
    refusing a write at its memory limit into ResourceExhausted."""

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is not None and is_connection_error(exc):
            raise Unavailable(f"redis is unreachable: {exc}") from exc
        if exc_type is not None and issubclass(exc_type, redis.exceptions.OutOfMemoryError):
            raise ResourceExhausted(
                f"redis refused the write at its memory limit (maxmemory): {exc}; nothing was "
                "stored"
            ) from exc
        return False


def _selected_fields(names: list[bytes], layers: tuple[int, ...]) -> list[bytes]:
    """The fields a layer-selected read fetches: all but route fields, and the route parts
    (``r@<row>:<j>``) of ``layers``. An old-format record's whole-block route fields are left
    out: it is refused for a selection."""
    wanted = {b"%d" % j for j in layers}
    return [
        name for name in names if not name.startswith(b"r@") or name.partition(b":")[2] in wanted
    ]


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


def old_format_message(sample_id: str, what: str) -> str:
    return (
        f"record {sample_id!r} is in storage format {OLD_FORMAT_VERSION} (one route field per "
        f"block, written before per-layer storage): it can be read whole but not {what}; "
        "it expires after the route cache's --ttl-s, or delete it and write it again"
    )


def _block_fields(block: StoredBlock, geometry: Geometry) -> tuple[str, dict]:
    """The block's descriptor (JSON) and its other fields: token/log-prob bytes, and one
    field of route bytes per MoE layer."""
    tokens = np.asarray(block.token_ids, "<i4").tobytes() + b"".join(
        np.asarray(t.logprobs, "<f4").tobytes() for t in block.turns
    )
    parts = block.routes
    if isinstance(parts, EncodedRoutes):
        parts = split_layers(parts, geometry)
    fields = {f"t@{block.row_start}": tokens}
    for layer, data in zip(parts.layers, parts.parts, strict=True):
        fields[f"r@{block.row_start}:{layer}"] = data
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
    return json.dumps(desc, separators=(",", ":")), fields


def _parse_record(
    sample_id: str, fields: dict, payload: bool = True, layers: tuple[int, ...] | None = None
) -> StoredRecord:
    """The record in ``fields`` (a hash's fields; with ``layers``, only those layers' route
    parts among them)."""
    geometry = json.loads(fields[b"geometry"])
    version = geometry.get("format")
    if version not in (FORMAT_VERSION, OLD_FORMAT_VERSION):
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
