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

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

import grpc

from routereplay.domain.codec import Encoding, encode_routes
from routereplay.domain.feed import ReadyPage, ReadyRead
from routereplay.domain.record import (
    Geometry,
    Missing,
    Record,
    Turn,
    TurnAppend,
    check_layer_selection,
)
from routereplay.errors import BY_STATUS, RouteReplayError
from routereplay.rpc.grpc_server import channel_options
from routereplay.rpc.security import PLAINTEXT, ClientSecurity, secure_aio_channel, secure_channel
from routereplay.rpc.wire import (
    DEFAULT_CHUNK_BYTES,
    ChunkFirst,
    RecordAssembler,
    append_requests,
    geometry_from_pb,
    layer_selection_to_pb,
    read_records,
    ready_page_from_pb,
    ready_read_to_pb,
    serialized,
    turn_from_pb,
    write_requests,
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


@dataclass(frozen=True)
class RetryPolicy:
    """UNAVAILABLE is retried up to ``attempts`` times in all, pausing ``backoff(attempt)``
    between: ``initial_backoff_s`` doubled each time up to ``max_backoff_s``, times a random
    0.5-1.

    The defaults ride through a Redis Cluster failover with the deployment's
    ``cluster-node-timeout`` of 5 s: the failover takes that time-out plus 1-1.5 s (the
    failure report and the replica's election delay; 2.0-2.5 s measured with a 1 s time-out),
    about 6.5 s, and the route cache then finds the new master within 0.1 s. The pauses add
    up to at least 9.35 s (0.05 + 0.1 + 0.2, then 36 of at least 0.25 s; at most 18.7 s), not
    counting the attempts themselves. The 0.5 s cap bounds how long a writer waits once
    Redis is back. (The earlier 5 attempts paused 0.75-1.5 s in all: writes failed through a
    failover.)
    """

    attempts: int = 40
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 0.5

    def backoff(self, attempt: int) -> float:
        base = min(self.max_backoff_s, self.initial_backoff_s * 2**attempt)
        return base * (0.5 + random.random() / 2)

    def pause_after(self, exc: grpc.RpcError, attempt: int) -> float:
        """Seconds to wait before retrying after ``exc`` failed ``attempt`` (0-based); raises
        its domain error when it is not retried (not UNAVAILABLE, or the last attempt). The
        sync and asyncio clients share this and differ only in how they wait."""
        if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt == self.attempts - 1:
            raise domain_error(exc) from None
        return self.backoff(attempt)


def domain_error(exc: grpc.RpcError) -> RouteReplayError:
    """The domain exception for a failed call, with the server's message."""
    code = exc.code()
    cls = BY_STATUS.get(code.name if code else "", RouteReplayError)
    return cls(exc.details() or str(code))


def _selection_pb(layers: Sequence[int] | None):
    """A checked layer selection for a read request (None: every layer)."""
    if layers is None:
        return None
    return layer_selection_to_pb(check_layer_selection(layers, name="layers"))


def _batch_request(sample_ids, skip_missing: bool, selection) -> route_cache_pb2.ReadBatchRequest:
    """A batch read of ``sample_ids``; after UNAVAILABLE the clients resume with the ids not
    yet delivered."""
    return route_cache_pb2.ReadBatchRequest(
        sample_ids=sample_ids, skip_missing=skip_missing, layers=selection, layer_parts=True
    )


def _stub(channel) -> route_cache_pb2_grpc.RouteCacheStub:
    """The generated stub (sync or asyncio channel), with the route chunks of writes sent as
    ``write_requests`` serialized them and those of reads parsed as views of the received
    messages (``ChunkFirst``)."""
    stub = route_cache_pb2_grpc.RouteCacheStub(channel)
    path = f"/{route_cache_pb2.DESCRIPTOR.services_by_name['RouteCache'].full_name}/"
    write = {
        "request_serializer": serialized,
        "response_deserializer": route_cache_pb2.WriteResponse.FromString,
    }
    stub.WriteRecord = channel.stream_unary(path + "WriteRecord", **write, _registered_method=True)
    stub.AppendTurn = channel.stream_unary(path + "AppendTurn", **write, _registered_method=True)
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


class _Base:
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


class RouteCacheClient(_Base):
    """Blocking client. Args: target ``host:port`` (or several replicas: see the module
    docstring); timeout_s per call; the retry policy;
    the encoding of written routes (RAW, or ZSTD for memory-bound Redis); chunk size; TLS and
    the bearer token (``routereplay.rpc.security.ClientSecurity``; plaintext by default)."""

    def __init__(self, target: str, **kwargs):
        super().__init__(target, **kwargs)
        self.channel = secure_channel(target, self.security, channel_options() + BALANCING_OPTIONS)
        self.stub = _stub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _call(self, fn):
        for attempt in range(self.retry.attempts):
            try:
                return fn()
            except grpc.RpcError as exc:
                time.sleep(self.retry.pause_after(exc, attempt))

    def write(self, record: Record, more_turns: bool = False) -> WriteResult:
        """Check, encode once, and store a new record (retried whole on UNAVAILABLE).

        The check here is structural; the server checks every expert id. ``more_turns``:
        announce it on the ready feed with its ``final`` append instead of now."""
        record.validate(check_ids=False)
        encoded = encode_routes(record.routes, self.encoding)
        return _write_result(
            self._call(
                lambda: self.stub.WriteRecord(
                    write_requests(record, encoded, self.chunk_bytes, more_turns),
                    timeout=self.timeout_s,
                )
            )
        )

    def append(self, append: TurnAppend, final: bool = False) -> WriteResult:
        """Append a turn; ``final``: the sample's last, announced on the ready feed."""
        append.validate(check_ids=False)
        encoded = encode_routes(append.routes, self.encoding)
        return _write_result(
            self._call(
                lambda: self.stub.AppendTurn(
                    append_requests(append, encoded, self.chunk_bytes, final),
                    timeout=self.timeout_s,
                )
            )
        )

    def read(self, sample_id: str, layers: Sequence[int] | None = None) -> Record:
        """One record; with ``layers`` (a range or ascending list of MoE layer indices, i.e.
        positions in ``geometry.moe_layers``) only those route columns, fetched and sent
        without the others: ``record.routes`` is ``[T - 1, len(layers), k]`` and
        ``record.layers`` names them (None for a whole record)."""
        request = route_cache_pb2.ReadRecordRequest(
            sample_id=sample_id, layers=_selection_pb(layers), layer_parts=True
        )

        def once():
            return next(read_records(self.stub.ReadRecord(request, timeout=self.timeout_s)))

        return self._call(once)

    def read_batch(
        self,
        sample_ids: Sequence[str],
        skip_missing: bool = False,
        layers: Sequence[int] | None = None,
    ) -> Iterator[Record | Missing]:
        """Records in the order asked, streamed; unknown ids raise NotFound, or come back as
        ``Missing`` with ``skip_missing``. ``layers``: as in ``read``, for every record.
        After UNAVAILABLE, resumes after the last one."""
        selection = _selection_pb(layers)
        done = 0
        for attempt in range(self.retry.attempts):
            request = _batch_request(sample_ids[done:], skip_missing, selection)
            try:
                for item in read_records(self.stub.ReadBatch(request, timeout=self.timeout_s)):
                    done += 1
                    yield item
                return
            except grpc.RpcError as exc:
                time.sleep(self.retry.pause_after(exc, attempt))

    def stat(self, sample_id: str) -> RecordInfo:
        request = route_cache_pb2.StatRecordRequest(sample_id=sample_id)
        return _info(self._call(lambda: self.stub.StatRecord(request, timeout=self.timeout_s)))

    def delete(self, sample_id: str) -> None:
        request = route_cache_pb2.DeleteRecordRequest(sample_id=sample_id)
        self._call(lambda: self.stub.DeleteRecord(request, timeout=self.timeout_s))

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
        timeout = self.timeout_s + block_ms / 1000
        for attempt in range(self.retry.attempts):
            try:
                return ready_page_from_pb(self.stub.ReadReady(request, timeout=timeout))
            except grpc.RpcError as exc:
                pause = self.retry.pause_after(exc, attempt)
                _after_lost_reply(request)
                time.sleep(pause)

    def ack_ready(self, consumer_group: str, entry_ids: Sequence[str], consumer: str = "") -> int:
        """Acknowledge ready entries (idempotent). Returns how many it settled (see AckReady:
        with ``consumer`` named, a retry after a lost answer counts them again)."""
        request = route_cache_pb2.AckReadyRequest(
            consumer_group=consumer_group, entry_ids=list(entry_ids), consumer=consumer
        )
        return self._call(lambda: self.stub.AckReady(request, timeout=self.timeout_s)).acknowledged


class AsyncRouteCacheClient(_Base):
    """The same calls for asyncio (``grpc.aio``)."""

    def __init__(self, target: str, **kwargs):
        super().__init__(target, **kwargs)
        self.channel = secure_aio_channel(
            target, self.security, channel_options() + BALANCING_OPTIONS
        )
        self.stub = _stub(self.channel)

    async def close(self) -> None:
        await self.channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await self.close()

    async def _call(self, fn):
        for attempt in range(self.retry.attempts):
            try:
                return await fn()
            except grpc.RpcError as exc:
                await asyncio.sleep(self.retry.pause_after(exc, attempt))

    async def write(self, record: Record, more_turns: bool = False) -> WriteResult:
        record.validate(check_ids=False)
        encoded = encode_routes(record.routes, self.encoding)
        response = await self._call(
            lambda: self.stub.WriteRecord(
                write_requests(record, encoded, self.chunk_bytes, more_turns),
                timeout=self.timeout_s,
            )
        )
        return _write_result(response)

    async def append(self, append: TurnAppend, final: bool = False) -> WriteResult:
        append.validate(check_ids=False)
        encoded = encode_routes(append.routes, self.encoding)
        response = await self._call(
            lambda: self.stub.AppendTurn(
                append_requests(append, encoded, self.chunk_bytes, final),
                timeout=self.timeout_s,
            )
        )
        return _write_result(response)

    async def read(self, sample_id: str, layers: Sequence[int] | None = None) -> Record:
        records = [r async for r in self.read_batch([sample_id], layers=layers)]
        return records[0]

    async def read_batch(
        self,
        sample_ids: Sequence[str],
        skip_missing: bool = False,
        layers: Sequence[int] | None = None,
    ) -> AsyncIterator[Record | Missing]:
        selection = _selection_pb(layers)
        done = 0
        for attempt in range(self.retry.attempts):
            request = _batch_request(sample_ids[done:], skip_missing, selection)
            try:
                assembler = RecordAssembler()
                async for response in self.stub.ReadBatch(request, timeout=self.timeout_s):
                    item = assembler.feed(response)
                    if item is not None:
                        done += 1
                        yield item
                return
            except grpc.RpcError as exc:
                await asyncio.sleep(self.retry.pause_after(exc, attempt))

    async def stat(self, sample_id: str) -> RecordInfo:
        request = route_cache_pb2.StatRecordRequest(sample_id=sample_id)
        return _info(
            await self._call(lambda: self.stub.StatRecord(request, timeout=self.timeout_s))
        )

    async def delete(self, sample_id: str) -> None:
        request = route_cache_pb2.DeleteRecordRequest(sample_id=sample_id)
        await self._call(lambda: self.stub.DeleteRecord(request, timeout=self.timeout_s))

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
    ) -> ReadyPage:
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
        timeout = self.timeout_s + block_ms / 1000
        for attempt in range(self.retry.attempts):
            try:
                return ready_page_from_pb(await self.stub.ReadReady(request, timeout=timeout))
            except grpc.RpcError as exc:
                pause = self.retry.pause_after(exc, attempt)
                _after_lost_reply(request)
                await asyncio.sleep(pause)

    async def ack_ready(
        self, consumer_group: str, entry_ids: Sequence[str], consumer: str = ""
    ) -> int:
        request = route_cache_pb2.AckReadyRequest(
            consumer_group=consumer_group, entry_ids=list(entry_ids), consumer=consumer
        )
        response = await self._call(lambda: self.stub.AckReady(request, timeout=self.timeout_s))
        return response.acknowledged
