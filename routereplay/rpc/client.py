"""Clients of the route cache, sync and asyncio, for the other services and for users.

Every call has a deadline; calls that fail with UNAVAILABLE are retried with exponential
backoff (writes and appends are idempotent, and a batch read resumes after the last record it
delivered). Errors come back as the domain exceptions of ``routereplay.errors``.

A target may name several replicas: a DNS name with an address per replica (a headless
Kubernetes Service: ``dns:///route-cache-headless:50051``) or a list
(``ipv4:10.0.0.1:50051,10.0.0.2:50051``). Calls are spread over every replica that is up
(gRPC's round_robin policy) and skip one that is down; its retry lands on another.

The ready feed (``read_ready``, ``ack_ready``) is read through ``routereplay.rpc.ready``'s
``ReadyConsumer``, which drops repeats and assembles whole GRPO groups.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from routereplay.domain.codec import Encoding, encode_layer_parts
from routereplay.domain.feed import ReadyPage, ReadyRead
from routereplay.domain.record import (
    Geometry,
    Missing,
    Record,
    Turn,
    TurnAppend,
    check_layer_selection,
)
from routereplay.rpc.chunks import DEFAULT_CHUNK_BYTES, ChunkFirst
from routereplay.rpc.grpc_server import channel_options
from routereplay.rpc.security import PLAINTEXT, ClientSecurity, secure_aio_channel, secure_channel
from routereplay.rpc.streams import BlockMessages, RecordAssembler, append_header, write_header
from routereplay.rpc.transport import AsyncIO, Blocking, RetryPolicy, Stream, Unary
from routereplay.rpc.wire import (
    geometry_from_pb,
    layer_selection_to_pb,
    ready_page_from_pb,
    ready_read_to_pb,
    turn_from_pb,
)
from routereplay.v1 import route_cache_pb2, route_cache_pb2_grpc

# gRPC's default policy, pick_first, sends every call to the first address that answers, for as
# long as it answers: replicas beyond it sit idle, and a client that failed over to another
# stays there. round_robin keeps a connection to every address and spreads calls over those
# that are up. Reconnection attempts to a replica that went down back off to at most 1 s (the
# default grows to 120 s), so a restarted replica takes calls again within about a second.
BALANCING_OPTIONS = [
    ("grpc.service_config", json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})),
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]


@dataclass(frozen=True)
class WriteResult:
    sample_id: str
    num_tokens: int
    num_rows: int
    duplicate: bool  # the same data was already stored


@dataclass(frozen=True)
class RecordInfo:
    """A record without its payload (StatRecord)."""

    sample_id: str
    group_id: str
    geometry: Geometry
    num_tokens: int
    num_rows: int
    turns: list[Turn]
    stored_bytes: int  # Redis's memory for the whole key (routes, tokens, metadata, overhead)
    ttl_ms: int
    route_bytes: int  # the route bytes as stored (encoded), the sum of the blocks' sizes


def _selection_pb(layers: Sequence[int] | None):
    """A checked layer selection for a read request (None: every layer)."""
    if layers is None:
        return None
    return layer_selection_to_pb(check_layer_selection(layers, name="layers"))


def _stub(channel) -> route_cache_pb2_grpc.RouteCacheStub:
    """The generated stub (sync or asyncio channel), with the messages of writes sent as
    ``BlockMessages`` serialized them (bytes: no request serializer) and those of reads
    parsed with their chunks as views of the received messages (``ChunkFirst``). A write or
    append of one message is also callable as a unary call (``WriteRecordUnary``,
    ``AppendTurnUnary``): the same method, the same bytes on the wire."""
    stub = route_cache_pb2_grpc.RouteCacheStub(channel)
    path = f"/{route_cache_pb2.DESCRIPTOR.services_by_name['RouteCache'].full_name}/"
    write = {
        "request_serializer": None,
        "response_deserializer": route_cache_pb2.WriteResponse.FromString,
        "_registered_method": True,
    }
    for method in ("WriteRecord", "AppendTurn"):
        setattr(stub, method, channel.stream_unary(path + method, **write))
        setattr(stub, method + "Unary", channel.unary_unary(path + method, **write))
    for method, request in (
        ("ReadRecord", route_cache_pb2.ReadRecordRequest),
        ("ReadBatch", route_cache_pb2.ReadBatchRequest),
    ):
        setattr(
            stub,
            method,
            channel.unary_stream(
                path + method,
                request_serializer=request.SerializeToString,
                response_deserializer=ChunkFirst(route_cache_pb2.ReadResponse),
                _registered_method=True,
            ),
        )
    return stub


def _write_result(response) -> WriteResult:
    return WriteResult(
        response.sample_id, response.num_tokens, response.num_rows, response.duplicate
    )


def _info(stat) -> RecordInfo:
    return RecordInfo(
        stat.sample_id,
        stat.group_id,
        geometry_from_pb(stat.geometry),
        stat.num_tokens,
        stat.num_rows,
        [turn_from_pb(t, i) for i, t in enumerate(stat.turns)],
        stat.stored_bytes,
        stat.ttl_ms,
        sum(block.encoded_size for block in stat.blocks),
    )


def _after_lost_reply(request: route_cache_pb2.ReadReadyRequest) -> None:
    """A read whose reply was lost may still have delivered new entries: they wait in this
    consumer's pending list, so the retry re-reads that list from its start."""
    if not request.pending_cursor:
        request.pending_cursor = "0"


# The call table: each RPC's reply converter and retry rule, for both clients.
WRITE = Unary("WriteRecord", _write_result)
APPEND = Unary("AppendTurn", _write_result)
# A write or append that fits in one message, made as a unary call.
WRITE_ONE = Unary("WriteRecordUnary", _write_result)
APPEND_ONE = Unary("AppendTurnUnary", _write_result)
STAT = Unary("StatRecord", _info)
DELETE = Unary("DeleteRecord", lambda reply: None)
READ_READY = Unary("ReadReady", ready_page_from_pb, before_retry=_after_lost_reply)
ACK_READY = Unary("AckReady", lambda reply: reply.acknowledged)
# A record stream; a retried batch read resumes after the last record it delivered.
READ = Stream("ReadRecord", lambda: RecordAssembler().feed)
READ_BATCH = Stream("ReadBatch", lambda: RecordAssembler().feed)


class _RouteCacheCalls:
    """The route cache's calls, written once: each builds its request and hands it to the
    transport with its table entry. ``RouteCacheClient`` returns the values;
    ``AsyncRouteCacheClient`` returns awaitables (``read_batch``: an async iterator)."""

    _transport_of: type[Blocking] | type[AsyncIO]

    def __init__(
        self,
        target: str,
        timeout_s: float = 60.0,
        retry: RetryPolicy | None = None,
        encoding: Encoding = Encoding.RAW,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        security: ClientSecurity = PLAINTEXT,
    ):
        self.target = target
        self.security = security
        self.timeout_s = timeout_s
        self.retry = retry or RetryPolicy()
        self.encoding = Encoding(encoding)
        self.chunk_bytes = chunk_bytes
        self.channel = self._open_channel(target, security, channel_options() + BALANCING_OPTIONS)
        self.stub = _stub(self.channel)
        self.transport = self._transport_of(self.stub, self.retry)

    def write(self, record: Record, more_turns: bool = False) -> WriteResult:
        """Check, encode once, and store a new record (retried whole on UNAVAILABLE).

        Routes go layer-major, one part per MoE layer with its checksum, as the route cache
        stores them (route caches of before this layout refuse such writes: upgrade them
        first). The check here is structural; the server checks every expert id. ``more_turns``:
        announce it on the ready feed with its ``final`` append instead of now."""
        record.validate(check_ids=False)
        encoded = encode_layer_parts(record.routes, self.encoding)
        header = write_header(record, encoded, more_turns)
        return self._send(WRITE, WRITE_ONE, BlockMessages(header, encoded, self.chunk_bytes))

    def append(self, append: TurnAppend, final: bool = False) -> WriteResult:
        """Append a turn; ``final``: the sample's last, announced on the ready feed."""
        append.validate(check_ids=False)
        encoded = encode_layer_parts(append.routes, self.encoding)
        header = append_header(append, encoded, final)
        return self._send(APPEND, APPEND_ONE, BlockMessages(header, encoded, self.chunk_bytes))

    def _send(self, stream: Unary, unary: Unary, messages: BlockMessages):
        """A block's messages as a request stream, or in one unary call when they are one."""
        if messages.single:
            return self.transport.unary(unary, next(messages()), self.timeout_s)
        return self.transport.unary(stream, messages, self.timeout_s)

    def read(self, sample_id: str, layers: Sequence[int] | None = None) -> Record:
        """One record; with ``layers`` (a range or ascending list of MoE layer indices, i.e.
        positions in ``geometry.moe_layers``) only those route columns, fetched and sent
        without the others: ``record.routes`` is ``[T - 1, len(layers), k]`` and
        ``record.layers`` names them (None for a whole record)."""
        request = route_cache_pb2.ReadRecordRequest(
            sample_id=sample_id,
            layers=_selection_pb(layers),
            layer_parts=True,
            first_chunk_with_record=True,
        )
        return self.transport.first(self.transport.stream(READ, request, self.timeout_s))

    def read_batch(
        self,
        sample_ids: Sequence[str],
        skip_missing: bool = False,
        layers: Sequence[int] | None = None,
        expire_after_s: float = 0.0,
    ) -> Iterator[Record | Missing]:
        """Records in the order asked, streamed; unknown ids raise NotFound, or come back as
        ``Missing`` with ``skip_missing``. ``layers``: as in ``read``, for every record.
        ``expire_after_s``: each record expires at most that long after this read (a trainer
        without the ready feed frees what it fetched). After UNAVAILABLE, resumes after the
        last one."""
        selection = _selection_pb(layers)

        def after(done: int) -> route_cache_pb2.ReadBatchRequest:
            return route_cache_pb2.ReadBatchRequest(
                sample_ids=sample_ids[done:],
                skip_missing=skip_missing,
                layers=selection,
                layer_parts=True,
                first_chunk_with_record=True,
                expire_after_ms=round(expire_after_s * 1000),
            )

        return self.transport.stream(READ_BATCH, after, self.timeout_s)

    def stat(self, sample_id: str) -> RecordInfo:
        request = route_cache_pb2.StatRecordRequest(sample_id=sample_id)
        return self.transport.unary(STAT, request, self.timeout_s)

    def delete(self, sample_id: str) -> None:
        request = route_cache_pb2.DeleteRecordRequest(sample_id=sample_id)
        return self.transport.unary(DELETE, request, self.timeout_s)

    def read_ready(
        self,
        consumer_group: str,
        consumer: str,
        max_entries: int = 256,
        block_ms: int = 0,
        pending_cursor: str = "",
        claim_idle_ms: int = 0,
        claim_cursor: str = "",
        start_from_latest: bool = False,
    ) -> ReadyPage:
        """One read of the ready feed (the ReadReady call; see its docs in the proto).

        A retried read (UNAVAILABLE) re-reads this consumer's pending entries, so entries a
        lost reply delivered are not stranded: expect repeats; ``ReadyConsumer`` drops them."""
        request = ready_read_to_pb(
            ReadyRead(
                consumer_group,
                consumer,
                max_entries,
                block_ms,
                pending_cursor,
                claim_idle_ms,
                claim_cursor,
                start_from_latest,
            )
        )
        return self.transport.unary(READ_READY, request, self.timeout_s + block_ms / 1000)

    def ack_ready(
        self,
        consumer_group: str,
        entry_ids: Sequence[str],
        consumer: str = "",
        sample_ids: Sequence[str] = (),
        dead_letter_ids: Sequence[str] = (),
        dead_letter_reason: str = "",
    ) -> int:
        """Acknowledge ready entries (idempotent). Returns how many it settled (see AckReady:
        with ``consumer`` named, a retry after a lost answer counts them again; with each
        entry's sample named, an entry the stream lost counts as its sample's others;
        ``dead_letter_ids``, samples of them that trained nothing, go to the dead-letter
        stream with ``dead_letter_reason``)."""
        request = route_cache_pb2.AckReadyRequest(
            consumer_group=consumer_group,
            entry_ids=list(entry_ids),
            consumer=consumer,
            sample_ids=list(sample_ids),
            dead_letter_ids=list(dead_letter_ids),
            dead_letter_reason=dead_letter_reason,
        )
        return self.transport.unary(ACK_READY, request, self.timeout_s)


class RouteCacheClient(_RouteCacheCalls):
    """Blocking client. Args: target ``host:port`` (or several replicas: see the module
    docstring); timeout_s per call; the retry policy; the encoding of written routes (RAW, or
    ZSTD for memory-bound Redis); chunk size; TLS and the bearer token
    (``routereplay.rpc.security.ClientSecurity``; plaintext by default)."""

    _transport_of = Blocking
    _open_channel = staticmethod(secure_channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class AsyncRouteCacheClient(_RouteCacheCalls):
    """The same calls for asyncio (``grpc.aio``): each returns an awaitable, and
    ``read_batch`` an async iterator."""

    _transport_of = AsyncIO
    _open_channel = staticmethod(secure_aio_channel)

    if TYPE_CHECKING:  # the shared calls' types here: awaitables, and an async iterator

        async def write(self, record: Record, more_turns: bool = False) -> WriteResult: ...
        async def append(self, append: TurnAppend, final: bool = False) -> WriteResult: ...
        async def read(self, sample_id: str, layers: Sequence[int] | None = None) -> Record: ...
        def read_batch(
            self,
            sample_ids: Sequence[str],
            skip_missing: bool = False,
            layers: Sequence[int] | None = None,
            expire_after_s: float = 0.0,
        ) -> AsyncIterator[Record | Missing]: ...
        async def stat(self, sample_id: str) -> RecordInfo: ...
        async def delete(self, sample_id: str) -> None: ...
        async def read_ready(
            self,
            consumer_group: str,
            consumer: str,
            max_entries: int = 256,
            block_ms: int = 0,
            pending_cursor: str = "",
            claim_idle_ms: int = 0,
            claim_cursor: str = "",
            start_from_latest: bool = False,
        ) -> ReadyPage: ...
        async def ack_ready(
            self,
            consumer_group: str,
            entry_ids: Sequence[str],
            consumer: str = "",
            sample_ids: Sequence[str] = (),
            dead_letter_ids: Sequence[str] = (),
            dead_letter_reason: str = "",
        ) -> int: ...

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()
