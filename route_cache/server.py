"""The RouteCache servicer (protobuf in, calls on the ``RouteCache`` core, protobuf out) and
the server process."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
from google.protobuf.message_factory import GetMessageClass

from route_cache.budget import MemoryBudget, Upkeep
from route_cache.cache import NAMESPACE, BlockWrite, RouteCache, Stored
from route_cache.config import Config
from route_cache.feed import ReadyFeed
from route_cache.record_format import StoredRecord
from route_cache.store import RouteStore
from routereplay.domain.codec import LayerParts, join_layers
from routereplay.domain.record import Missing
from routereplay.errors import InvalidArgument
from routereplay.rpc.chunks import (
    DEFAULT_CHUNK_BYTES,
    ChunkCollector,
    ChunkFirst,
    Headed,
    chunk_messages,
    chunk_of,
    first_chunk_of,
    message_part,
)
from routereplay.rpc.grpc_server import make_server, set_serving, wait_for_termination
from routereplay.rpc.metrics import ServiceMetrics
from routereplay.rpc.security import add_port
from routereplay.rpc.wire import (
    block_header_from_pb,
    block_to_pb,
    geometry_from_pb,
    geometry_to_pb,
    layer_selection_to_pb,
    ready_page_to_pb,
    ready_read_from_pb,
    tokens_from_pb,
    turn_from_pb,
    turn_to_pb,
)
from routereplay.v1 import route_cache_pb2, route_cache_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = route_cache_pb2.DESCRIPTOR.services_by_name["RouteCache"].full_name


class RouteCacheServicer(route_cache_pb2_grpc.RouteCacheServicer):
    """Thin: converts messages, calls ``RouteCache``; domain errors become statuses in the
    interceptor."""

    def __init__(self, cache: RouteCache):
        self.cache = cache

    def WriteRecord(self, request_iterator, context):
        first = _first_part(request_iterator, "header")
        header = first.header
        write = _block_write(
            header, header.group_id, row_offset=0, append=False, announce=not header.more_turns
        )
        return _stored_to_pb(self.cache.write(write, _route_bytes(first, request_iterator)))

    def AppendTurn(self, request_iterator, context):
        first = _first_part(request_iterator, "header")
        header = first.header
        write = _block_write(header, "", header.row_offset, append=True, announce=header.final)
        return _stored_to_pb(self.cache.write(write, _route_bytes(first, request_iterator)))

    def ReadRecord(self, request, context):
        layers = _selection(request)
        record = self.cache.read(request.sample_id, layers)
        yield from _record_responses(record, request)

    def ReadBatch(self, request, context):
        records = self.cache.read_many(
            request.sample_ids, _selection(request), request.skip_missing, request.expire_after_ms
        )
        for record in records:
            if isinstance(record, Missing):
                yield route_cache_pb2.ReadResponse(missing_sample_id=record.sample_id)
            else:
                yield from _record_responses(record, request)

    def StatRecord(self, request, context):
        stat = self.cache.stat(request.sample_id)
        record = stat.record
        return route_cache_pb2.RecordStat(
            sample_id=record.sample_id,
            group_id=record.group_id,
            geometry=geometry_to_pb(record.geometry),
            num_tokens=stat.num_tokens,
            num_rows=record.num_rows,
            turns=[turn_to_pb(t, with_logprobs=False) for t in record.turns],
            blocks=[
                block_to_pb(b.routes, b.row_start, record.geometry, sizes)
                for b, sizes in zip(record.blocks, stat.block_sizes, strict=True)
            ],
            stored_bytes=stat.stored_bytes,
            ttl_ms=stat.ttl_ms,
        )

    def DeleteRecord(self, request, context):
        self.cache.delete(request.sample_id)
        return route_cache_pb2.DeleteRecordResponse()

    def ReadReady(self, request, context):
        return ready_page_to_pb(self.cache.read_ready(ready_read_from_pb(request)))

    def AckReady(self, request, context):
        acknowledged = self.cache.ack_ready(
            request.consumer_group,
            request.entry_ids,
            request.consumer,
            request.sample_ids,
            request.dead_letter_ids,
            request.dead_letter_reason,
        )
        return route_cache_pb2.AckReadyResponse(acknowledged=acknowledged)


def _block_write(header, group_id: str, row_offset: int, append: bool, announce: bool):
    geometry = geometry_from_pb(header.geometry)
    geometry.validate()  # before the block's dtype is checked against it
    return BlockWrite(
        sample_id=header.sample_id,
        geometry=geometry,
        token_ids=tokens_from_pb(header.token_ids),
        turns=[turn_from_pb(t, i) for i, t in enumerate(header.turns)],
        block=block_header_from_pb(header.block, geometry),
        group_id=group_id,
        append=append,
        row_offset=row_offset,
        announce=announce,
    )


def _route_bytes(first, request_iterator) -> Iterator[bytes]:
    """The bytes of the stream's chunks, in order (the first may come with the header,
    ``first``), refusing any out of place."""
    collector = ChunkCollector(0, first.header.block.encoded_size)
    chunk = first_chunk_of(first)
    while True:
        if chunk is None:
            chunk = chunk_of(_next_part(request_iterator, "chunk"))
        last = collector.check(chunk)
        yield chunk.data
        if last:
            return
        chunk = None


def _stored_to_pb(stored: Stored) -> route_cache_pb2.WriteResponse:
    return route_cache_pb2.WriteResponse(
        sample_id=stored.sample_id,
        num_tokens=stored.num_rows + 1,
        num_rows=stored.num_rows,
        duplicate=stored.duplicate,
    )


def _selection(request) -> list[int] | None:
    return list(request.layers.indices) if request.HasField("layers") else None


def _record_responses(
    record: StoredRecord, request
) -> Iterator[route_cache_pb2.ReadResponse | bytes]:
    """A record's header, then each block's encoded bytes as 1 MiB chunks (chunk messages
    serialized here, which the server sends as they are): the client verifies the checksums
    and decodes. Layer parts go as stored (the selected ones, back to back); a reader that
    asked for neither parts nor a selection gets each block whole. The first chunk goes
    in the header's message where the reader asked (``first_chunk_with_record``)."""
    layers = record.layers
    routes = [b.routes for b in record.blocks]
    if not (request.layer_parts or layers is not None):
        routes = [
            join_layers(r, record.geometry) if isinstance(r, LayerParts) else r for r in routes
        ]
    info = route_cache_pb2.RecordInfo(
        sample_id=record.sample_id,
        group_id=record.group_id,
        geometry=geometry_to_pb(record.geometry),
        token_ids=record.token_ids.astype("<i4", copy=False).tobytes(),
        turns=[turn_to_pb(t) for t in record.turns],
        blocks=[
            block_to_pb(r, b.row_start, record.geometry)
            for r, b in zip(routes, record.blocks, strict=True)
        ],
        layers=layer_selection_to_pb(layers),
    )
    header = route_cache_pb2.ReadResponse(record=info)
    if not (request.first_chunk_with_record and routes):
        yield header
        header = None
    for index, (block, encoded) in enumerate(zip(record.blocks, routes, strict=True)):
        if not isinstance(encoded, LayerParts):
            pieces = (encoded.data,)
        else:
            pieces = encoded.parts if block.data is None else (block.data,)
        first = None if header is None or index else Headed.of(header)
        yield from chunk_messages(pieces, index, DEFAULT_CHUNK_BYTES, first)


def _next_part(request_iterator, part: str):
    request = next(request_iterator, None)
    if request is None:
        raise InvalidArgument("the stream ended before the chunk marked last: nothing was stored")
    if message_part(request) != part:
        raise InvalidArgument(f"expected a {part} message, got {message_part(request)}")
    return request


def _first_part(request_iterator, part: str):
    request = next(request_iterator, None)
    if request is None or message_part(request) != part:
        raise InvalidArgument(f"the first message of the stream must be the {part}")
    return request


# Requests whose route chunks are read as views of the received message (``ChunkFirst``).
_CHUNKED_REQUESTS = {
    "WriteRecord": route_cache_pb2.WriteRecordRequest,
    "AppendTurn": route_cache_pb2.AppendTurnRequest,
}


# (client streaming, server streaming) -> grpc's handler factory.
_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _add_servicer(servicer: RouteCacheServicer, server) -> None:
    """Register every method of the RouteCache service, built from the proto's own descriptor
    (the generated ``add_RouteCacheServicer_to_server`` does the same, except that write and
    append streams here parse their chunks with ``ChunkFirst``)."""
    service = route_cache_pb2.DESCRIPTOR.services_by_name["RouteCache"]
    handlers = {}
    for method in service.methods:
        kind = _HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        request = _CHUNKED_REQUESTS.get(method.name)
        handlers[method.name] = kind(
            getattr(servicer, method.name),
            request_deserializer=(
                ChunkFirst(request) if request else GetMessageClass(method.input_type).FromString
            ),
            response_serializer=GetMessageClass(method.output_type).SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),)
    )
    server.add_registered_method_handlers(service.full_name, handlers)


class RedisHealth:
    """Readiness follows Redis: NOT_SERVING while it cannot be reached, or takes longer than
    ``timeout_s`` to answer a ping (a hung server accepts connections and answers nothing, so
    the ping would block for the client's whole socket time-out).

    The ping runs on a thread of its own; a hung one is waited for again at the next probe,
    never started twice. Any error of the ping counts as unreachable and is logged: the thread
    that owns readiness must not die, or readiness would stay as it was for good."""

    def __init__(self, store: RouteStore, health_servicer, interval_s: float, timeout_s: float):
        self.store = store
        self.health = health_servicer
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.serving: bool | None = None
        self._stop = threading.Event()
        self._lock = threading.Lock()  # no status set after stop()
        self._ping: futures.Future | None = None

    def start(self) -> None:
        """Probe once now (the first status), then every ``interval_s`` on a thread."""
        self._set(self.probe())
        threading.Thread(target=self._run, name="redis-health", daemon=True).start()

    def stop(self) -> None:
        with self._lock:
            self._stop.set()

    def probe(self) -> bool:
        """One probe: True when Redis answered a ping within ``timeout_s``."""
        if self._ping is None or self._ping.done():
            self._ping = _in_daemon_thread(self.store.ping)
        try:
            return bool(self._ping.result(timeout=self.timeout_s))
        except futures.TimeoutError:
            return False
        except Exception:  # noqa: BLE001 - any failure of the probe means not ready
            log.exception("redis health probe failed")
            return False

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._set(self.probe())
            except Exception:  # noqa: BLE001 - readiness must keep following Redis
                log.exception("redis health tracking failed; retrying")
            self._stop.wait(self.interval_s)

    def _set(self, ok: bool) -> None:
        with self._lock:
            if ok != self.serving and not self._stop.is_set():
                log.info("redis %s", "reachable: SERVING" if ok else "unreachable: NOT_SERVING")
                set_serving(self.health, [SERVICE_NAME], ok)
                self.serving = ok


def _in_daemon_thread(fn) -> futures.Future:
    """``fn()`` on a new daemon thread (a ping hung on a dead socket must not hold up the
    process's exit, as an executor's worker would)."""
    future: futures.Future = futures.Future()

    def run():
        try:
            future.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits
            future.set_exception(exc)

    threading.Thread(target=run, name="redis-health-ping", daemon=True).start()
    return future


# How often the ready stream is trimmed of what every consumer group acknowledged, and how
# often freed records whose grace is over are deleted.
TRIM_INTERVAL_S = 1.0
SWEEP_INTERVAL_S = 0.25
FREE_INTERVAL_S = 1.0  # what an acknowledgement left in the freeing set (ReadyFeed.free)


class RouteCacheServer:
    """The route cache process: ``start()``, then ``stop(grace)`` or ``wait()``."""

    def __init__(self, config: Config, store: RouteStore):
        self.config = config
        self.store = store
        self.feed = (
            ReadyFeed(
                store.client,
                config.ready_stream,
                config.ready_maxlen,
                store.wait_replicas,
                store.wait_timeout_ms,
                store.ttl_ms,
                config.commit_group_names,
                int(config.free_grace_s * 1000),
            )
            if config.ready_stream
            else None
        )
        self.budget = MemoryBudget(store.client, config.memory_budget)
        self.metrics = ServiceMetrics(NAMESPACE)
        self.grpc_server, self.health = make_server(
            config.limits, [SERVICE_NAME], config.security, self.metrics
        )
        self.cache = RouteCache(store, config, self.feed, self.metrics.registry, self.budget)
        tasks = [(self.budget.interval_s, self.budget.read)] if config.memory_budget else []
        if self.feed is not None:
            tasks += [
                (TRIM_INTERVAL_S, self.feed.trim),
                (FREE_INTERVAL_S, self.feed.free),
                (SWEEP_INTERVAL_S, self.feed.sweep),
            ]
        self.upkeep = Upkeep(tasks)
        self.servicer = RouteCacheServicer(self.cache)
        _add_servicer(self.servicer, self.grpc_server)
        self.port = add_port(self.grpc_server, f"{config.host}:{config.port}", config.security)
        self.redis_health = RedisHealth(
            store, self.health, config.health_interval_s, config.health_timeout_s
        )

    def start(self) -> RouteCacheServer:
        self.redis_health.start()
        self.upkeep.start()
        self.grpc_server.start()
        self.metrics.serve(self.config.metrics)
        if self.metrics.port:
            log.info(
                "metrics at http://%s:%d/metrics",
                self.config.metrics.metrics_host,
                self.metrics.port,
            )
        log.info("route cache listening on %s:%d", self.config.host, self.port)
        return self

    def stop(self, grace_s: float | None = None) -> None:
        self.redis_health.stop()
        self.upkeep.stop()
        set_serving(self.health, [SERVICE_NAME], False)
        self.grpc_server.stop(self.config.grace_s if grace_s is None else grace_s).wait()
        self.metrics.stop()

    def wait(self) -> None:
        """Serve until SIGTERM/SIGINT, then stop gracefully."""
        wait_for_termination(self.grpc_server, self.config.grace_s, on_stop=self._stop_threads)
        self.metrics.stop()

    def _stop_threads(self) -> None:
        self.redis_health.stop()
        self.upkeep.stop()
