"""The route cache's core, free of gRPC: writes, appends, reads and the ready feed on domain
objects, with the checks and limits that guard them.

A write or append arrives as a ``BlockWrite`` (the header: ids, geometry, tokens, turns, and
how its route block is encoded) and the block's bytes as pieces in order. Nothing is stored
until every check has passed: the header against the record's own validators, the bytes
against the header's size and checksum, the decoded routes against the geometry. The servicer
in ``server.py`` only converts messages to these calls and back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from route_cache.budget import MemoryBudget
from route_cache.config import Config
from route_cache.feed import ReadyFeed, check_entry_id
from route_cache.record_format import RecordStat, StoredBlock, StoredRecord, record_key
from route_cache.store import RouteStore
from routereplay.domain import idcheck
from routereplay.domain.codec import (
    BlockHeader,
    EncodedRoutes,
    Encoding,
    LayerParts,
    checksum,
    decode_layer_parts,
    decode_routes,
)
from routereplay.domain.feed import ReadyEntry, ReadyPage, ReadyRead
from routereplay.domain.record import (
    Geometry,
    Missing,
    Turn,
    check_layer_major_ids,
    check_layer_selection,
    check_routes,
    check_sample_id,
    check_token_ids,
    check_turns,
)
from routereplay.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from routereplay.rpc.metrics import children

log = logging.getLogger(__name__)

NAMESPACE = "route_cache"
# A zstd block may exceed the raw size of its rows by its frame headers.
_ZSTD_SLACK = 1024


@dataclass(frozen=True)
class BlockWrite:
    """A write (rows ``[0, T - 1)`` for T tokens) or, with ``append``, an append of N tokens
    (rows ``[row_offset, row_offset + N)``, ``row_offset`` the stored row count), before its
    route bytes.

    ``announce``: publish the record to the ready feed once stored (a write that is not
    followed by more turns; an append marked final).
    """

    sample_id: str
    geometry: Geometry
    token_ids: np.ndarray
    turns: list[Turn]
    block: BlockHeader
    group_id: str = ""
    append: bool = False
    row_offset: int = 0
    announce: bool = True

    @property
    def token_start(self) -> int:
        """The record's index of ``token_ids[0]``: an append's first new token follows the
        stored ``row_offset + 1`` tokens."""
        return self.row_offset + 1 if self.append else 0

    @property
    def num_rows(self) -> int:
        return int(self.token_ids.size) - (0 if self.append else 1)


@dataclass(frozen=True)
class Stored:
    """What a write or append left: the record's row count, and whether it was a retry."""

    sample_id: str
    num_rows: int
    duplicate: bool


class CacheMetrics:
    """The route cache's own counters, beside the per-call ones of ``ServiceMetrics``.

    ``route_bytes_served`` counts the route bytes of the records read (encoded, the selected
    layers only): what a trainer's reads cost the route cache, to hold against the stored
    bytes of the records read.
    """

    def __init__(
        self, registry: CollectorRegistry, feed: ReadyFeed | None, budget: MemoryBudget | None
    ):
        self.route_bytes_served = Counter(
            "route_bytes_served",
            "Encoded route bytes served by reads (the selected layers only)",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.route_bytes_received = Counter(
            "route_bytes_received",
            "Encoded route bytes received in writes and appends",
            namespace=NAMESPACE,
            registry=registry,
        )
        self.committed = Counter(
            "records_committed",
            "Writes and appends committed (duplicate: a retry, unchanged)",
            ["call", "duplicate"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.refused = Counter(
            "records_refused",
            "Writes and appends refused, by status code",
            ["call", "code"],
            namespace=NAMESPACE,
            registry=registry,
        )
        self.committed_as, self.refused_as = children(self.committed), children(self.refused)
        if feed is not None:
            registry.register(_BacklogCollector(feed))
        if budget is not None and budget.fraction:
            registry.register(_MemoryCollector(budget))


class _BacklogCollector:
    """The ready feed's backlog per consumer group, asked of Redis at each scrape."""

    def __init__(self, feed: ReadyFeed):
        self.feed = feed

    def collect(self):
        lag = GaugeMetricFamily(
            f"{NAMESPACE}_ready_backlog",
            "Ready entries not yet delivered to the consumer group",
            labels=["consumer_group"],
        )
        pending = GaugeMetricFamily(
            f"{NAMESPACE}_ready_pending",
            "Ready entries delivered and not acknowledged",
            labels=["consumer_group"],
        )
        oldest = GaugeMetricFamily(
            f"{NAMESPACE}_ready_oldest_unconsumed_age_seconds",
            "Age of the oldest entry the consumer group has pending or not yet delivered",
            labels=["consumer_group"],
        )
        try:
            groups = self.feed.backlog()
        except Exception:  # noqa: BLE001 - a scrape must not fail while Redis is away
            log.warning("ready feed backlog unavailable", exc_info=True)
            groups = []
        now_ms = time.time() * 1000
        for group, unread, unacked, oldest_ms in groups:
            if unread is not None:
                lag.add_metric([group], unread)
            pending.add_metric([group], unacked)
            if oldest_ms is not None:
                oldest.add_metric([group], max(0.0, (now_ms - oldest_ms) / 1000))
        freed = CounterMetricFamily(
            f"{NAMESPACE}_records_freed",
            "Records freed once every commit group acknowledged them (this process)",
        )
        freed.add_metric([], self.feed.freed)
        trimmed = CounterMetricFamily(
            f"{NAMESPACE}_ready_entries_trimmed",
            "Ready entries trimmed once every consumer group acknowledged them (this process)",
        )
        trimmed.add_metric([], self.feed.trimmed)
        dead = CounterMetricFamily(
            f"{NAMESPACE}_ready_dead_letters",
            "Samples settled untrained (record lost) and added to the dead-letter stream "
            "(this process)",
        )
        dead.add_metric([], self.feed.dead_lettered)
        yield from (lag, pending, oldest, freed, trimmed, dead)


class _MemoryCollector:
    """Each Redis node's memory against the budget, as the budget last read it."""

    def __init__(self, budget: MemoryBudget):
        self.budget = budget

    def collect(self):
        used = GaugeMetricFamily(
            f"{NAMESPACE}_redis_used_memory_bytes",
            "Redis used_memory per node (records in flight are nearly all of it)",
            labels=["node"],
        )
        share = GaugeMetricFamily(
            f"{NAMESPACE}_memory_budget_used_ratio",
            "Redis used_memory over the memory budget, per node (1: writes are refused)",
            labels=["node"],
        )
        for node, memory in self.budget.nodes.items():
            used.add_metric([node], memory.used)
        for node, ratio in self.budget.used_fraction().items():
            share.add_metric([node], ratio)
        refused = CounterMetricFamily(
            f"{NAMESPACE}_writes_refused_for_memory",
            "Writes and appends refused at the memory budget (RESOURCE_EXHAUSTED; retried)",
        )
        refused.add_metric([], self.budget.refused)
        yield from (used, share, refused)


class RouteCache:
    """Args: the store; the configuration (its limits); the ready feed, or None when it is
    disabled; the registry its metrics go to (a private one when None); the memory budget
    writes are held to (none when None)."""

    def __init__(
        self,
        store: RouteStore,
        config: Config,
        feed: ReadyFeed | None = None,
        registry: CollectorRegistry | None = None,
        budget: MemoryBudget | None = None,
    ):
        self.store = store
        self.config = config
        self.feed = feed
        self.budget = budget or MemoryBudget(store.client, 0.0)
        self.metrics = CacheMetrics(registry or CollectorRegistry(), feed, self.budget)
        idcheck.warm_up()  # the id check's kernels compiled (or loaded) before the first write

    # Writes ------------------------------------------------------------------------------

    def write(self, write: BlockWrite, data: Iterable[bytes]) -> Stored:
        """Store a new record from ``write`` and its route bytes, or find it already stored
        (a retry: ``duplicate``).

        Raises:
            InvalidArgument: the header or the bytes are wrong (nothing is stored).
            ResourceExhausted: more pieces than ``max_write_chunks``.
            AlreadyExists: a different record has this id.
        """
        return self._counted("append" if write.append else "write", self._store, write, data)

    def _counted(self, call: str, store, write: BlockWrite, data: Iterable[bytes]) -> Stored:
        try:
            stored = store(write, data)
        except Exception as exc:
            self.metrics.refused_as(call, getattr(exc, "status", "INTERNAL")).inc()
            raise
        self.metrics.committed_as(call, str(stored.duplicate).lower()).inc()
        return stored

    def _store(self, write: BlockWrite, data: Iterable[bytes]) -> Stored:
        # A duplicate is announced again: the first announcement may have been lost. The
        # writer hears back only after the announcement, so its retries make delivery at
        # least once.
        with self.budget.reserve(record_key(write.sample_id), write.block.encoded_size):
            return self._commit(write, data)

    def _commit(self, write: BlockWrite, data: Iterable[bytes]) -> Stored:
        block = self._receive(write, data)
        announce = self.feed is not None and write.announce
        if write.append:
            duplicate, rows = self.store.append(write.sample_id, write.geometry, block)
            if announce:  # the whole record's turns: one more read, on final appends
                held = self.store.stat(write.sample_id).record
                self.feed.publish(_ready_entry(write.sample_id, held.group_id, rows, held.turns))
            return Stored(write.sample_id, rows, duplicate)
        rows = block.routes.num_rows
        entry = _ready_entry(write.sample_id, write.group_id, rows, write.turns)
        announcement = self.feed.announcement(entry) if announce else None
        duplicate = self.store.write(
            write.sample_id, write.group_id, write.geometry, block, announcement
        )
        if announce and announcement is None:  # the stream has its own server (a Cluster)
            self.feed.publish(entry)
        return Stored(write.sample_id, rows, duplicate)

    def _receive(self, write: BlockWrite, data: Iterable[bytes]) -> StoredBlock:
        """Check the header, receive the route bytes and check the routes they hold."""
        self._check_header(write)
        pieces = []
        for piece in data:
            if len(pieces) == self.config.max_write_chunks:
                raise ResourceExhausted(
                    f"the stream sent more than {self.config.max_write_chunks} chunks, the "
                    "server's limit (max_write_chunks): send larger chunks; nothing was stored"
                )
            pieces.append(piece)
        joined = b"".join(pieces)  # the pieces may be views of the received messages
        if len(joined) != write.block.encoded_size:
            raise InvalidArgument(
                f"the route bytes hold {len(joined)} bytes; block.encoded_size is "
                f"{write.block.encoded_size}"
            )
        self.metrics.route_bytes_received.inc(len(joined))
        header = write.block
        if header.parts is not None:
            parts = _received_parts(header, joined, write.geometry)
            return StoredBlock(
                header.row_start, write.token_start, write.token_ids, write.turns, parts, joined
            )
        encoded = EncodedRoutes(header.encoding, joined, header.checksum, header.num_rows)
        try:
            routes = decode_routes(encoded, write.geometry)
        except DataLoss as exc:
            raise InvalidArgument(f"{exc}: the routes changed in transit") from None
        check_routes(routes, write.geometry, header.num_rows, header.row_start)
        return StoredBlock(
            header.row_start, write.token_start, write.token_ids, write.turns, encoded
        )

    def _check_header(self, write: BlockWrite) -> None:
        check_sample_id(write.sample_id)
        if write.group_id:
            check_sample_id(write.group_id, "group_id")
        geometry, block = write.geometry, write.block
        geometry.validate()
        check_token_ids(write.token_ids)
        if write.token_ids.size == 0:
            raise InvalidArgument("token_ids is empty")
        check_turns(write.turns, write.token_start, write.token_start + int(write.token_ids.size))
        if (block.row_start, block.num_rows) != (write.row_offset, write.num_rows):
            raise InvalidArgument(
                f"block covers rows [{block.row_start}, {block.row_start + block.num_rows}); "
                f"the tokens need rows [{write.row_offset}, {write.row_offset + write.num_rows})"
            )
        limit = block.num_rows * geometry.row_bytes
        if block.encoded_size > limit + _ZSTD_SLACK:
            raise InvalidArgument(
                f"block.encoded_size {block.encoded_size} exceeds raw size {limit}"
            )
        if block.encoded_size > self.config.max_record_bytes:
            raise InvalidArgument(
                f"block.encoded_size {block.encoded_size} exceeds the server's limit "
                f"of {self.config.max_record_bytes} bytes"
            )

    # Reads -------------------------------------------------------------------------------

    def read(self, sample_id: str, layers: Sequence[int] | None = None) -> StoredRecord:
        """One record, of the MoE layers selected (positions in its geometry; None: all)."""
        check_sample_id(sample_id)
        record = self.store.read(sample_id, _selection(layers))
        self._served(record)
        return record

    def read_many(
        self,
        sample_ids: Sequence[str],
        layers: Sequence[int] | None = None,
        skip_missing: bool = False,
        expire_after_ms: int = 0,
    ) -> Iterator[StoredRecord | Missing]:
        """Records in the order asked, streamed as they come from Redis; with
        ``expire_after_ms``, each expires at most that long after this read (set first, so a
        read abandoned midway still frees what it asked for).

        Raises:
            NotFound: an id has no record (unless ``skip_missing``: a ``Missing`` in its place).
        """
        ids = self._ids(sample_ids, "sample_ids", check_sample_id)
        if expire_after_ms:
            self.store.expire_within(ids, expire_after_ms)
        for sample_id, record in zip(
            ids, self.store.read_many(ids, _selection(layers)), strict=True
        ):
            if record is not None:
                self._served(record)
                yield record
            elif skip_missing:
                yield Missing(sample_id)
            else:
                raise NotFound(f"no record for sample_id {sample_id!r}")

    def _served(self, record: StoredRecord) -> None:
        self.metrics.route_bytes_served.inc(record.route_bytes)

    def stat(self, sample_id: str) -> RecordStat:
        check_sample_id(sample_id)
        return self.store.stat(sample_id)

    def delete(self, sample_id: str) -> None:
        check_sample_id(sample_id)
        self.store.delete(sample_id)
        if self.feed is not None:  # a record written again under this id is trained anew
            self.feed.forget(sample_id)

    # Ready feed --------------------------------------------------------------------------

    def read_ready(self, read: ReadyRead) -> ReadyPage:
        """See ``ReadyFeed.read``; the request checked against the server's limits."""
        feed = self._feed()
        check_sample_id(read.consumer_group, "consumer_group")
        check_sample_id(read.consumer, "consumer")
        if not 1 <= read.max_entries <= self.config.max_batch:
            raise InvalidArgument(
                f"max_entries is {read.max_entries}; it must be in [1, {self.config.max_batch}]"
            )
        if read.block_ms > self.config.ready_max_block_ms:
            raise InvalidArgument(
                f"block_ms is {read.block_ms}; the limit is {self.config.ready_max_block_ms}"
            )
        if read.pending_cursor:
            check_entry_id(read.pending_cursor, "pending_cursor")
        if read.claim_cursor:
            check_entry_id(read.claim_cursor, "claim_cursor")
        return feed.read(read)

    def ack_ready(
        self,
        group: str,
        entry_ids: Sequence[str],
        consumer: str = "",
        sample_ids: Sequence[str] = (),
        dead_letter_ids: Sequence[str] = (),
        dead_letter_reason: str = "",
    ) -> int:
        feed = self._feed()
        check_sample_id(group, "consumer_group")
        if consumer:
            check_sample_id(consumer, "consumer")
        entry_ids = self._ids(entry_ids, "entry_ids", check_entry_id)
        if sample_ids:
            sample_ids = self._ids(sample_ids, "sample_ids", check_sample_id)
            if len(sample_ids) != len(entry_ids):
                raise InvalidArgument(
                    f"sample_ids has {len(sample_ids)} ids for {len(entry_ids)} entry_ids; "
                    "name one sample per entry, or none"
                )
        dead = set(dead_letter_ids)
        if dead:
            if not dead <= set(sample_ids):
                raise InvalidArgument(
                    f"dead_letter_ids {sorted(dead - set(sample_ids))[:8]} are not in sample_ids"
                )
            if not 0 < len(dead_letter_reason) <= 256 or not dead_letter_reason.isprintable():
                raise InvalidArgument(
                    "dead_letter_reason must be 1 to 256 printable characters with "
                    f"dead_letter_ids, got {dead_letter_reason[:64]!r}"
                )
        return feed.ack(group, entry_ids, consumer, sample_ids, dead, dead_letter_reason)

    def _ids(self, values: Sequence[str], name: str, check) -> list[str]:
        """A non-empty list of at most ``max_batch`` ids, each passing ``check``."""
        ids = list(values)
        if not ids:
            raise InvalidArgument(f"{name} is empty")
        if len(ids) > self.config.max_batch:
            raise InvalidArgument(
                f"{name} has {len(ids)} ids; the limit is {self.config.max_batch}"
            )
        for i, value in enumerate(ids):
            check(value, f"{name}[{i}]")
        return ids

    def _feed(self) -> ReadyFeed:
        if self.feed is None:
            raise FailedPrecondition(
                "the ready feed is disabled on this route cache (--ready-stream is empty)"
            )
        return self.feed


def _received_parts(header: BlockHeader, joined: bytes, geometry: Geometry) -> LayerParts:
    """A layer-major block's parts (views of ``joined``), each checksum verified and every
    expert id checked in one pass (RAW) or after inflating each layer (ZSTD)."""
    rows, view, offset = header.num_rows, memoryview(joined), 0
    layer_bytes = rows * geometry.topk * geometry.dtype.itemsize
    parts = []
    for layer, (size, expected) in enumerate(header.parts):
        part = view[offset : offset + size]
        offset += size
        if header.encoding is Encoding.RAW and size != layer_bytes:
            raise InvalidArgument(
                f"block.layer_parts[{layer}] holds {size} bytes; {rows} rows x "
                f"top-{geometry.topk} as {geometry.dtype} need {layer_bytes}"
            )
        if checksum(part) != expected:
            raise InvalidArgument(
                f"route checksum mismatch in MoE layer index {layer} ({size} bytes, {rows} "
                "rows): the routes changed in transit"
            )
        parts.append(part)
    layers = tuple(range(geometry.num_moe_layers))
    received = LayerParts(
        header.encoding, rows, layers, tuple(parts), tuple(c for _, c in header.parts)
    )
    if header.encoding is Encoding.RAW:
        shape = (geometry.num_moe_layers, rows, geometry.topk)
        check_layer_major_ids(
            np.frombuffer(joined, geometry.dtype).reshape(shape), geometry, header.row_start
        )
    else:
        routes = decode_layer_parts(received, geometry)  # inflates each frame, size-checked
        check_routes(routes, geometry, rows, header.row_start)
    return received


def _ready_entry(sample_id: str, group_id: str, rows: int, turns: Sequence[Turn]) -> ReadyEntry:
    versions = tuple(t.policy_version for t in turns)
    return ReadyEntry("", sample_id, group_id, rows + 1, versions)


def _selection(layers: Sequence[int] | None) -> tuple[int, ...] | None:
    """A layer selection checked for order here, and against each record's geometry when it
    is read; None when absent (every layer)."""
    return None if layers is None else check_layer_selection(layers, name="layers.indices")
