"""The RouteCache servicer (protobuf in, calls on the ``RouteCache`` core, protobuf out) and
the server process."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator

import grpc

from route_cache.cache import NAMESPACE, BlockWrite, RouteCache, Stored
from route_cache.config import Config
from route_cache.feed import ReadyFeed
from route_cache.store import RouteStore, StoredRecord
from routereplay.domain.codec import LayerParts, join_layers
from routereplay.domain.record import Missing
from routereplay.errors import InvalidArgument
from routereplay.rpc.grpc_server import make_server, set_serving, wait_for_termination
from routereplay.rpc.metrics import ServiceMetrics
from routereplay.rpc.security import add_port
from routereplay.rpc.wire import (
    DEFAULT_CHUNK_BYTES,
    ChunkCollector,
    ChunkFirst,
    block_header_from_pb,
    block_to_pb,
    chunk_messages,
    chunk_of,
    geometry_from_pb,
    geometry_to_pb,
    layer_selection_to_pb,
    message_part,
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
        header = _first_part(request_iterator, "header").header
        write = _block_write(header, header.group_id, row_offset=0, append=False,
                             announce=not header.more_turns)  # fmt: skip
        return _stored_to_pb(self.cache.write(write, _route_bytes(header, request_iterator)))

    def AppendTurn(self, request_iterator, context):
        header = _first_part(request_iterator, "header").header
        write = _block_write(header, "", header.row_offset, append=True, announce=header.final)
        return _stored_to_pb(self.cache.write(write, _route_bytes(header, request_iterator)))

    def ReadRecord(self, request, context):
        layers = _selection(request)
        record = self.cache.read(request.sample_id, layers)
        yield from _record_responses(record, request.layer_parts)

    def ReadBatch(self, request, context):
        records = self.cache.read_many(request.sample_ids, _selection(request),
                                       request.skip_missing)  # fmt: skip
        for record in records:
            if isinstance(record, Missing):
                yield route_cache_pb2.ReadResponse(missing_sample_id=record.sample_id)
            else:
                yield from _record_responses(record, request.layer_parts)

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
        acknowledged = self.cache.ack_ready(request.consumer_group, request.entry_ids)
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


def _route_bytes(header, request_iterator) -> Iterator[bytes]:
    """The bytes of the stream's chunks, in order, refusing any out of place."""
    collector = ChunkCollector(0, header.block.encoded_size)
    while True:
        chunk = chunk_of(_next_part(request_iterator, "chunk"))
        last = collector.check(chunk)
        yield chunk.data
        if last:
            return


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
    record: StoredRecord, layer_parts: bool
) -> Iterator[route_cache_pb2.ReadResponse | bytes]:
    """A record's header, then each block's encoded bytes as 1 MiB chunks (chunk messages
    serialized here, which the server sends as they are): the client verifies the checksums
    and decodes. Layer parts go as stored (the selected ones, back to back); a reader that
    asked for neither parts nor a selection gets each block whole."""
    layers = record.layers
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
        yield from chunk_messages(parts, index, DEFAULT_CHUNK_BYTES)


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


class _Handlers:
    """Collects the method handlers the generated ``add_RouteCacheServicer_to_server``
    registers."""

    def add_generic_rpc_handlers(self, handlers) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict) -> None:
        self.service, self.handlers = service, handlers


def _add_servicer(servicer: RouteCacheServicer, server) -> None:
    """The generated registration, with write and append streams parsed by ``ChunkFirst``
    (their chunks as views of the received messages)."""
    collected = _Handlers()
    route_cache_pb2_grpc.add_RouteCacheServicer_to_server(servicer, collected)
    handlers = dict(collected.handlers)
    for method, message in (("WriteRecord", route_cache_pb2.WriteRecordRequest),
                            ("AppendTurn", route_cache_pb2.AppendTurnRequest)):  # fmt: skip
        handlers[method] = handlers[method]._replace(request_deserializer=ChunkFirst(message))
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(collected.service, handlers),)
    )
    server.add_registered_method_handlers(collected.service, handlers)


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
        self.cache = RouteCache(store, config, self.feed, self.metrics.registry)
        self.servicer = RouteCacheServicer(self.cache)
        _add_servicer(self.servicer, self.grpc_server)
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
