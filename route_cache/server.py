"""The RouteCache servicer: protobuf in, validated domain objects to the store, protobuf out."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

from prometheus_client import Counter
from prometheus_client.core import GaugeMetricFamily

from route_cache.config import Config
from route_cache.feed import ReadyFeed, check_entry_id
from route_cache.store import RouteStore, StoredBlock, StoredRecord
from routereplay.domain.codec import LayerParts, decode_routes, join_layers
from routereplay.domain.record import (
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
from routereplay.rpc.grpc_server import make_server, set_serving, wait_for_termination
from routereplay.rpc.metrics import ServiceMetrics
from routereplay.rpc.ready import ReadyEntry
from routereplay.rpc.security import add_port
from routereplay.rpc.wire import (
    DEFAULT_CHUNK_BYTES,
    ChunkCollector,
    block_to_pb,
    check_block,
    encoded_from_pb,
    geometry_from_pb,
    geometry_to_pb,
    layer_selection_to_pb,
    part_chunks_to_pb,
    ready_page_to_pb,
    tokens_from_pb,
    turn_from_pb,
    turn_to_pb,
)
from routereplay.v1 import route_cache_pb2, route_cache_pb2_grpc

log = logging.getLogger(__name__)

NAMESPACE = "route_cache"
SERVICE_NAME = route_cache_pb2.DESCRIPTOR.services_by_name["RouteCache"].full_name


class RouteCacheMetrics:
    """The route cache's own metrics, beside the per-call ones of ``ServiceMetrics``.

    ``route_bytes_served`` counts the route bytes of read responses as sent (encoded, the
    selected layers only): what a trainer's reads cost the route cache, to hold against the
    stored bytes of the records read.
    """

    def __init__(self, metrics: ServiceMetrics, feed: ReadyFeed | None):
        registry = metrics.registry
        self.route_bytes_served = Counter(
            "route_bytes_served", "Encoded route bytes sent in read responses",
            namespace=NAMESPACE, registry=registry,
        )  # fmt: skip
        self.route_bytes_received = Counter(
            "route_bytes_received", "Encoded route bytes received in writes and appends",
            namespace=NAMESPACE, registry=registry,
        )  # fmt: skip
        self.committed = Counter(
            "records_committed", "Writes and appends committed (duplicate: a retry, unchanged)",
            ["call", "duplicate"], namespace=NAMESPACE, registry=registry,
        )  # fmt: skip
        self.refused = Counter(
            "records_refused", "Writes and appends refused, by status code",
            ["call", "code"], namespace=NAMESPACE, registry=registry,
        )  # fmt: skip
        if feed is not None:
            registry.register(_BacklogCollector(feed))


class _BacklogCollector:
    """The ready feed's backlog per consumer group, asked of Redis at each scrape."""

    def __init__(self, feed: ReadyFeed):
        self.feed = feed

    def collect(self):
        lag = GaugeMetricFamily(
            f"{NAMESPACE}_ready_backlog", "Ready entries not yet delivered to the consumer group",
            labels=["consumer_group"],
        )  # fmt: skip
        pending = GaugeMetricFamily(
            f"{NAMESPACE}_ready_pending", "Ready entries delivered and not acknowledged",
            labels=["consumer_group"],
        )  # fmt: skip
        try:
            groups = self.feed.backlog()
        except Exception:  # noqa: BLE001 - a scrape must not fail while Redis is away
            log.warning("ready feed backlog unavailable", exc_info=True)
            groups = []
        for group, unread, unacked in groups:
            if unread is not None:
                lag.add_metric([group], unread)
            pending.add_metric([group], unacked)
        yield lag
        yield pending


class RouteCacheServicer(route_cache_pb2_grpc.RouteCacheServicer):
    """Args: the store; the configuration; the ready feed, or None when it is disabled; the
    metrics (a private registry when None)."""

    def __init__(
        self,
        store: RouteStore,
        config: Config,
        feed: ReadyFeed | None = None,
        metrics: ServiceMetrics | None = None,
    ):
        self.store = store
        self.config = config
        self.feed = feed
        self.metrics = RouteCacheMetrics(metrics or ServiceMetrics(NAMESPACE), feed)

    def WriteRecord(self, request_iterator, context):
        return self._counted("write", self._write, request_iterator)

    def AppendTurn(self, request_iterator, context):
        return self._counted("append", self._append, request_iterator)

    def _counted(self, call: str, handler, request_iterator):
        try:
            response = handler(request_iterator)
        except Exception as exc:
            self.metrics.refused.labels(call, getattr(exc, "status", "INTERNAL")).inc()
            raise
        self.metrics.committed.labels(call, str(response.duplicate).lower()).inc()
        return response

    def _write(self, request_iterator):
        header = _first_part(request_iterator, "header").header
        check_sample_id(header.sample_id)
        if header.group_id:
            check_sample_id(header.group_id, "group_id")
        block = self._receive_block(header, request_iterator, row_start=0, token_start=0)
        duplicate = self.store.write(
            header.sample_id, header.group_id, geometry_from_pb(header.geometry), block
        )
        rows = block.routes.num_rows
        if self.feed is not None and not header.more_turns:
            # A duplicate is announced again: the first announcement may have been lost.
            # The writer hears back only after this, so its retries make delivery at least once.
            versions = tuple(t.policy_version for t in block.turns)
            self.feed.publish(ReadyEntry("", header.sample_id, header.group_id, rows + 1, versions))
        return route_cache_pb2.WriteResponse(
            sample_id=header.sample_id, num_tokens=rows + 1, num_rows=rows, duplicate=duplicate
        )

    def _append(self, request_iterator):
        header = _first_part(request_iterator, "header").header
        check_sample_id(header.sample_id)
        offset = header.row_offset
        block = self._receive_block(header, request_iterator, offset, token_start=offset + 1)
        duplicate, rows = self.store.append(
            header.sample_id, geometry_from_pb(header.geometry), block
        )
        if self.feed is not None and header.final:
            # The whole record's turns (one more read, on final appends only); as for writes,
            # a retried final append announces again.
            record = self.store.stat(header.sample_id).record
            versions = tuple(t.policy_version for t in record.turns)
            self.feed.publish(ReadyEntry("", header.sample_id, record.group_id, rows + 1, versions))
        return route_cache_pb2.WriteResponse(
            sample_id=header.sample_id, num_tokens=rows + 1, num_rows=rows, duplicate=duplicate
        )

    def _receive_block(self, header, request_iterator, row_start: int, token_start: int):
        """Validate a write's header, receive its chunks and validate the routes they hold.

        A write holds rows ``[0, T - 1)`` for T tokens; an append of N tokens holds rows
        ``[row_offset, row_offset + N)``.
        """
        geometry = geometry_from_pb(header.geometry)
        geometry.validate()
        token_ids = tokens_from_pb(header.token_ids)
        check_token_ids(token_ids)
        if token_ids.size == 0:
            raise InvalidArgument("token_ids is empty")
        turns = [turn_from_pb(t, i) for i, t in enumerate(header.turns)]
        check_turns(turns, token_start, token_start + int(token_ids.size))
        num_rows = int(token_ids.size) - (1 if row_start == 0 else 0)
        check_block(header.block, geometry, row_start, num_rows)
        if header.block.encoded_size > self.config.max_record_bytes:
            raise InvalidArgument(
                f"block.encoded_size {header.block.encoded_size} exceeds the server's limit "
                f"of {self.config.max_record_bytes} bytes"
            )
        collector = ChunkCollector(0, header.block.encoded_size)
        data, chunks = None, 0
        while data is None:
            chunks += 1
            if chunks > self.config.max_write_chunks:
                raise ResourceExhausted(
                    f"the stream sent more than {self.config.max_write_chunks} chunks, the "
                    "server's limit (max_write_chunks): send larger chunks; nothing was stored"
                )
            data = collector.add(_next_part(request_iterator, "chunk").chunk)
        self.metrics.route_bytes_received.inc(len(data))
        encoded = encoded_from_pb(header.block, data)
        try:
            routes = decode_routes(encoded, geometry)
        except DataLoss as exc:
            raise InvalidArgument(f"{exc}: the routes changed in transit") from None
        check_routes(routes, geometry, num_rows, row_start)
        return StoredBlock(row_start, token_start, token_ids, turns, encoded)

    def ReadRecord(self, request, context):
        check_sample_id(request.sample_id)
        layers = _selection(request)
        record = self.store.read(request.sample_id, layers)
        yield from _record_responses(record, layers, request.layer_parts, self.metrics)

    def ReadBatch(self, request, context):
        ids = self._ids(request.sample_ids, "sample_ids", check_sample_id)
        layers = _selection(request)
        for sample_id, record in zip(ids, self.store.read_many(ids, layers), strict=True):
            if record is not None:
                yield from _record_responses(record, layers, request.layer_parts, self.metrics)
            elif request.skip_missing:
                yield route_cache_pb2.ReadResponse(missing_sample_id=sample_id)
            else:
                raise NotFound(f"no record for sample_id {sample_id!r}")

    def StatRecord(self, request, context):
        check_sample_id(request.sample_id)
        stat = self.store.stat(request.sample_id)
        record = stat.record
        return route_cache_pb2.RecordStat(
            sample_id=record.sample_id,
            group_id=record.group_id,
            geometry=geometry_to_pb(record.geometry),
            num_tokens=stat.num_tokens,
            num_rows=record.num_rows,
            turns=[turn_to_pb(t, with_logprobs=False) for t in record.turns],
            blocks=[block_to_pb(b.routes, b.row_start, record.geometry) for b in record.blocks],
            stored_bytes=stat.stored_bytes,
            ttl_ms=stat.ttl_ms,
        )

    def DeleteRecord(self, request, context):
        check_sample_id(request.sample_id)
        self.store.delete(request.sample_id)
        return route_cache_pb2.DeleteRecordResponse()

    def ReadReady(self, request, context):
        feed = self._feed()
        check_sample_id(request.consumer_group, "consumer_group")
        check_sample_id(request.consumer, "consumer")
        if not 1 <= request.max_entries <= self.config.max_batch:
            raise InvalidArgument(
                f"max_entries is {request.max_entries}; it must be in [1, {self.config.max_batch}]"
            )
        if request.block_ms > self.config.ready_max_block_ms:
            raise InvalidArgument(
                f"block_ms is {request.block_ms}; the limit is {self.config.ready_max_block_ms}"
            )
        if request.pending_cursor:
            check_entry_id(request.pending_cursor, "pending_cursor")
        if request.claim_cursor:
            check_entry_id(request.claim_cursor, "claim_cursor")
        page = feed.read(
            request.consumer_group,
            request.consumer,
            request.max_entries,
            request.block_ms,
            request.pending_cursor,
            request.claim_idle_ms,
            request.claim_cursor,
            request.start_from_latest,
        )
        return ready_page_to_pb(page)

    def AckReady(self, request, context):
        feed = self._feed()
        check_sample_id(request.consumer_group, "consumer_group")
        ids = self._ids(request.entry_ids, "entry_ids", check_entry_id)
        return route_cache_pb2.AckReadyResponse(acknowledged=feed.ack(request.consumer_group, ids))

    def _ids(self, values, name: str, check) -> list[str]:
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


def _selection(request) -> tuple[int, ...] | None:
    """The request's MoE layer selection, checked for order here and against each record's
    geometry when it is read; None when absent (every layer)."""
    if not request.HasField("layers"):
        return None
    return check_layer_selection(request.layers.indices, name="layers.indices")


def _record_responses(
    record: StoredRecord,
    layers: tuple[int, ...] | None,
    layer_parts: bool,
    metrics: RouteCacheMetrics,
) -> Iterator[route_cache_pb2.ReadResponse]:
    """A record's header, then each block's encoded bytes as 1 MiB chunks: the client
    verifies the checksums and decodes. Layer parts go as stored (the selected ones, back to
    back); a reader that did not ask for parts gets each block reassembled whole."""
    routes = [b.routes for b in record.blocks]
    if not (layer_parts or layers is not None):
        routes = [join_layers(r, record.geometry) if isinstance(r, LayerParts) else r
                  for r in routes]  # fmt: skip
    info = route_cache_pb2.RecordInfo(
        sample_id=record.sample_id,
        group_id=record.group_id,
        geometry=geometry_to_pb(record.geometry),
        token_ids=record.token_ids.astype("<i4", copy=False).tobytes(),
        turns=[turn_to_pb(t) for t in record.turns],
        blocks=[
            block_to_pb(r, b.row_start, record.geometry)
            for r, b in zip(routes, record.blocks, strict=True)
        ],  # fmt: skip
        layers=layer_selection_to_pb(layers),
    )
    yield route_cache_pb2.ReadResponse(record=info)
    for index, encoded in enumerate(routes):
        parts = encoded.parts if isinstance(encoded, LayerParts) else (encoded.data,)
        metrics.route_bytes_served.inc(sum(len(p) for p in parts))
        for chunk in part_chunks_to_pb(parts, index, DEFAULT_CHUNK_BYTES):
            yield route_cache_pb2.ReadResponse(chunk=chunk)


def _next_part(request_iterator, part: str):
    request = next(request_iterator, None)
    if request is None:
        raise InvalidArgument("the stream ended before the chunk marked last: nothing was stored")
    if request.WhichOneof("part") != part:
        raise InvalidArgument(f"expected a {part} message, got {request.WhichOneof('part')}")
    return request


def _first_part(request_iterator, part: str):
    request = next(request_iterator, None)
    if request is None or request.WhichOneof("part") != part:
        raise InvalidArgument(f"the first message of the stream must be the {part}")
    return request


def _watch_redis(store: RouteStore, health_servicer, interval_s: float, stop: threading.Event):
    """Health follows Redis: NOT_SERVING while it is unreachable."""
    serving = None
    while not stop.is_set():
        ok = store.ping()
        if ok != serving:
            log.info("redis %s", "reachable: SERVING" if ok else "unreachable: NOT_SERVING")
            set_serving(health_servicer, [SERVICE_NAME], ok)
            serving = ok
        stop.wait(interval_s)


class RouteCacheServer:
    """The route cache process: ``start()``, then ``stop(grace)`` or ``wait()``."""

    def __init__(self, config: Config, store: RouteStore):
        self.config = config
        self.store = store
        self.feed = (
            ReadyFeed(store.client, config.ready_stream, config.ready_maxlen)
            if config.ready_stream
            else None
        )
        self.metrics = ServiceMetrics(NAMESPACE)
        self.grpc_server, self.health = make_server(
            config.limits, [SERVICE_NAME], config.security, self.metrics
        )
        self.servicer = RouteCacheServicer(store, config, self.feed, self.metrics)
        route_cache_pb2_grpc.add_RouteCacheServicer_to_server(self.servicer, self.grpc_server)
        self.port = add_port(self.grpc_server, f"{config.host}:{config.port}", config.security)
        self._stop_watch = threading.Event()

    def start(self) -> RouteCacheServer:
        set_serving(self.health, [SERVICE_NAME], self.store.ping())
        self.grpc_server.start()
        self.metrics.serve(self.config.metrics)
        if self.metrics.port:
            log.info("metrics at http://%s:%d/metrics", self.config.metrics.metrics_host,
                     self.metrics.port)  # fmt: skip
        threading.Thread(
            target=_watch_redis,
            args=(self.store, self.health, self.config.health_interval_s, self._stop_watch),
            daemon=True,
        ).start()
        log.info("route cache listening on %s:%d", self.config.host, self.port)
        return self

    def stop(self, grace_s: float | None = None) -> None:
        self._stop_watch.set()
        set_serving(self.health, [SERVICE_NAME], False)
        self.grpc_server.stop(self.config.grace_s if grace_s is None else grace_s).wait()
        self.metrics.stop()

    def wait(self) -> None:
        """Serve until SIGTERM/SIGINT, then stop gracefully."""
        wait_for_termination(self.grpc_server, self.config.grace_s, on_stop=self._stop_watch.set)
        self.metrics.stop()
