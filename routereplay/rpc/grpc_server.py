"""What every Router Replay gRPC server shares: request parsing and the error interceptor, the
token check, explicit limits, the health and reflection services, and a graceful stop on
SIGTERM/SIGINT.

Two flavours with the same behaviour: thread-pool servers (``make_server``) and asyncio
servers (``make_aio_server``), for services whose work is bound to one event loop (the
rollout server's engine).

Why the error interceptor comes twice (``ErrorInterceptor``, ``AioErrorInterceptor``) and not
from one wrapper: grpcio calls a thread-pool handler as a plain function or generator and an
asyncio handler as a coroutine function or async generator, and an abort is a call in one and
an ``await`` in the other. One body cannot be both ``def`` and ``async def``; bridging them
would put a sync/async adapter in every call and hide where a call can block. So everything
but those bodies is shared (``_Meter``, ``_request_parser``, ``_domain_answer``, ``_wrap``),
and each flavour keeps only its two wrappers and its abort."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
import time
from collections.abc import Iterable
from concurrent import futures
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from routereplay.errors import RETRY_AFTER_TRAILER, InvalidArgument, RouteReplayError
from routereplay.rpc.metrics import ServiceMetrics
from routereplay.rpc.security import AioTokenInterceptor, ServerSecurity, TokenInterceptor
from routereplay.rpc.service_config import flag

log = logging.getLogger(__name__)

MIB = 1 << 20

# A health service name that is SERVING from the server's start until the process ends,
# whatever its dependencies do: the target of liveness probes. The overall status ("") and the
# services' own names follow the dependencies (Redis, the engine) and drive readiness; a
# liveness probe on them would restart every replica during a Redis outage.
LIVENESS = "routereplay.v1.Liveness"

# Health checks run on threads of their own, never queued behind calls: with every handler
# thread held by calls that wait on a hung dependency, a probe would miss its time-out (the
# kubelet's is 1 s) and a busy, live replica would be restarted. Check only: Watch streams hold
# their thread for as long as they are open.
HEALTH_CHECK_METHOD = "/grpc.health.v1.Health/Check"
HEALTH_THREADS = 2

# HTTP/2 settings for clients and servers alike. Measured with 1 MiB chunks on loopback: the
# defaults stream about 630 MiB/s; a larger write buffer and frame size about 1,200 MiB/s.
TRANSPORT_OPTIONS = [
    ("grpc.http2.write_buffer_size", 8 * MIB),
    ("grpc.http2.max_frame_size", 16 * MIB - 1),
]


def channel_options(max_message_bytes: int = 8 * MIB) -> list[tuple[str, int]]:
    return [
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        *TRANSPORT_OPTIONS,
    ]


@dataclass(frozen=True)
class ServerLimits:
    """Limits that keep one client from exhausting a server; see the fields' help.
    ``max_connection_age_s`` makes the server send HTTP/2 GOAWAY (gRPC adds +-10% jitter) so
    long-lived channels reach replicas added since they connected."""

    max_message_bytes: int = flag(8 * MIB, "largest gRPC message")
    max_concurrent_rpcs: int = flag(64, "in-flight calls before RESOURCE_EXHAUSTED")
    max_concurrent_streams: int = flag(32, "HTTP/2 streams per connection")
    workers: int = flag(16, "handler threads")
    max_connection_age_s: float = flag(
        300.0, "seconds before a client is asked to reconnect (0: never)"
    )
    max_connection_age_grace_s: float = flag(
        60.0, "seconds calls may finish on a connection past its age"
    )

    def __post_init__(self):
        for name in ("max_connection_age_s", "max_connection_age_grace_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


NO_SECURITY = ServerSecurity()

INTERNAL_MESSAGE = "internal error (details are in the server log)"


def _status_code(exc: BaseException) -> grpc.StatusCode:
    """The status a call that raised ``exc`` ends with, for the metrics."""
    if isinstance(exc, RouteReplayError):
        return grpc.StatusCode[exc.status]
    if isinstance(exc, GeneratorExit | asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    return grpc.StatusCode.INTERNAL


class _Meter:
    """One call's metrics: request bytes as they are parsed, response bytes as they leave,
    and its status and latency when it ends. A no-op without metrics."""

    def __init__(self, metrics: ServiceMetrics | None, method: str):
        self.metrics, self.method = metrics, method
        self.started = time.perf_counter()
        self.code = grpc.StatusCode.OK

    def parsed(self, parse):
        if self.metrics is None:
            return parse

        def counted(raw: bytes):
            self.metrics.received(self.method, len(raw))
            return parse(raw)

        return counted

    def sent(self, response) -> None:
        if self.metrics is not None and response is not None:
            size = len(response) if isinstance(response, bytes) else response.ByteSize()
            self.metrics.sent(self.method, size)

    def failed(self, exc: BaseException, context=None) -> None:
        self.code = _status_code(exc)
        if isinstance(exc, grpc.aio.AbortError) and context is not None:
            self.code = context.code() or grpc.StatusCode.UNKNOWN  # the handler's own abort

    def done(self) -> None:
        if self.metrics is not None:
            self.metrics.observe(self.method, self.code, self.started)


def _domain_answer(context, exc: Exception) -> tuple[grpc.StatusCode, str] | None:
    """The status and message a domain error is answered with, its ``retry-after-ms``
    trailer set when it says when to try again; None for anything else."""
    if not isinstance(exc, RouteReplayError):
        return None
    if (after := getattr(exc, "retry_after_s", None)) is not None:
        context.set_trailing_metadata(((RETRY_AFTER_TRAILER, str(round(after * 1000))),))
    return grpc.StatusCode[exc.status], str(exc)


def _abort(context: grpc.ServicerContext, exc: Exception, method: str):
    if (status := _domain_answer(context, exc)) is not None:
        context.abort(*status)
    if not context.is_active():  # the client went away: nothing to answer
        raise exc
    log.exception("unexpected error in %s", method)
    context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)


async def _abort_aio(context: grpc.aio.ServicerContext, exc: Exception, method: str):
    if isinstance(exc, grpc.aio.AbortError):  # the handler aborted with its own status
        raise exc
    if (status := _domain_answer(context, exc)) is not None:
        await context.abort(*status)
    if context.done():  # the client went away: nothing to answer
        raise exc
    log.exception("unexpected error in %s", method)
    await context.abort(grpc.StatusCode.INTERNAL, INTERNAL_MESSAGE)


def _request_parser(deserializer):
    """Turns a request's bytes into its message; bytes that are not one are INVALID_ARGUMENT.

    Servers register every method with pass-through (bytes) deserializers and parse here:
    grpcio's own deserializer answers undecodable bytes with INTERNAL and leaves the call's
    HTTP/2 stream open, so enough garbage from one client stalls its whole connection."""
    if deserializer is None:
        return lambda raw: raw
    message = getattr(getattr(deserializer, "__self__", deserializer), "DESCRIPTOR", None)
    name = message.full_name if message is not None else "request message"

    def parse(raw: bytes):
        try:
            return deserializer(raw)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the client's
            raise InvalidArgument(f"request is not a valid {name}: {exc}") from None

    return parse


class ErrorInterceptor(grpc.ServerInterceptor):
    """Parses requests (see ``_request_parser``) and maps domain errors to their status with
    their message; anything else is logged in full and answered with a generic INTERNAL, so
    internals never leak to clients. With ``metrics``, counts every call (see ``_Meter``).
    With ``health_pool``, health checks run there rather than on the server's handler threads
    (grpcio's ``experimental_thread_pool`` hook, read when it dispatches a call)."""

    def __init__(
        self,
        metrics: ServiceMetrics | None = None,
        health_pool: futures.ThreadPoolExecutor | None = None,
    ):
        self.metrics = metrics
        self.health_pool = health_pool

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        parse = _request_parser(handler.request_deserializer)
        metrics = self.metrics
        pool = self.health_pool if method == HEALTH_CHECK_METHOD else None

        def unary(behavior, convert):
            def wrapped(request, context):
                meter = _Meter(metrics, method)
                try:
                    response = behavior(convert(request, meter), context)
                    meter.sent(response)
                    return response
                except Exception as exc:  # noqa: BLE001 - mapped to a status
                    meter.failed(exc)
                    _abort(context, exc, method)
                finally:
                    meter.done()

            if pool is not None:
                wrapped.experimental_thread_pool = pool
            return wrapped

        def streaming(behavior, convert):
            def wrapped(request, context):
                meter = _Meter(metrics, method)
                try:
                    for response in behavior(convert(request, meter), context):
                        meter.sent(response)
                        yield response
                except GeneratorExit as exc:  # the client went away mid-stream
                    meter.failed(exc)
                    raise
                except Exception as exc:  # noqa: BLE001 - mapped to a status
                    meter.failed(exc)
                    _abort(context, exc, method)
                finally:
                    meter.done()

            return wrapped

        def parse_stream(request_iterator, meter):
            return map(meter.parsed(parse), request_iterator)

        return _wrap(handler, unary, streaming, parse, parse_stream)


class AioErrorInterceptor(grpc.aio.ServerInterceptor):
    """``ErrorInterceptor`` for asyncio servers: the same parsing, mapping of errors and
    metrics.

    Cancellation (a client that went away) is not an ``Exception`` and passes through.
    """

    def __init__(self, metrics: ServiceMetrics | None = None):
        self.metrics = metrics

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        parse = _request_parser(handler.request_deserializer)
        metrics = self.metrics

        async def parse_stream(request_iterator, meter):
            counted = meter.parsed(parse)
            async for raw in request_iterator:
                yield counted(raw)

        def unary(behavior, convert):
            async def wrapped(request, context):
                meter = _Meter(metrics, method)
                try:
                    response = await behavior(convert(request, meter), context)
                    meter.sent(response)
                    return response
                except asyncio.CancelledError as exc:
                    meter.failed(exc)
                    raise
                except Exception as exc:  # noqa: BLE001 - mapped to a status
                    meter.failed(exc, context)
                    await _abort_aio(context, exc, method)
                finally:
                    meter.done()

            return wrapped

        def streaming(behavior, convert):
            async def wrapped(request, context):
                meter = _Meter(metrics, method)
                try:
                    async for response in behavior(convert(request, meter), context):
                        meter.sent(response)
                        yield response
                except (asyncio.CancelledError, GeneratorExit) as exc:
                    meter.failed(exc)
                    raise
                except Exception as exc:  # noqa: BLE001 - mapped to a status
                    meter.failed(exc, context)
                    await _abort_aio(context, exc, method)
                finally:
                    meter.done()

            return wrapped

        return _wrap(handler, unary, streaming, parse, parse_stream)


def _wrap(handler, unary, streaming, parse, parse_stream):
    """``handler`` taking bytes, its behavior wrapped for its kind; its responses may be
    messages or messages already serialized (bytes, sent as they are). ``parse``: a request's
    bytes to its message; ``parse_stream``: the same over a request stream."""

    def parse_one(raw, meter):
        return meter.parsed(parse)(raw)

    kinds = {
        "unary_unary": (unary, parse_one),
        "stream_unary": (unary, parse_stream),
        "unary_stream": (streaming, parse_one),
        "stream_stream": (streaming, parse_stream),
    }
    for kind, (wrap, convert) in kinds.items():
        behavior = getattr(handler, kind)
        if behavior is not None:
            return handler._replace(
                request_deserializer=None,
                response_serializer=_serialized_or(handler.response_serializer),
                **{kind: wrap(behavior, convert)},
            )
    return handler


def _serialized_or(serializer):
    if serializer is None:
        return None
    return lambda response: response if isinstance(response, bytes) else serializer(response)


def _options(limits: ServerLimits) -> list[tuple[str, int]]:
    options = [
        *channel_options(limits.max_message_bytes),
        ("grpc.max_concurrent_streams", limits.max_concurrent_streams),
    ]
    if limits.max_connection_age_s > 0:
        options += [
            ("grpc.max_connection_age_ms", round(limits.max_connection_age_s * 1000)),
            ("grpc.max_connection_age_grace_ms", round(limits.max_connection_age_grace_s * 1000)),
        ]
    return options


def _add_health_and_reflection(server, health_servicer, service_names: Iterable[str]):
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = list(service_names)
    reflection.enable_server_reflection(
        [*names, reflection.SERVICE_NAME, health.SERVICE_NAME], server
    )
    return names


def make_server(
    limits: ServerLimits,
    service_names: Iterable[str],
    security: ServerSecurity = NO_SECURITY,
    metrics: ServiceMetrics | None = None,
) -> tuple[grpc.Server, health.HealthServicer]:
    """A server with the interceptors (the token check when ``security`` has a token; the
    call metrics into ``metrics`` when given), the limits, health (NOT_SERVING until told
    otherwise; ``LIVENESS`` SERVING; checks answered on threads of their own, see
    ``HEALTH_CHECK_METHOD``) and reflection. Add the servicers, then
    ``routereplay.rpc.security.add_port`` (TLS when ``security`` has a certificate) and ``start``.

    Raises:
        ValueError: a secret file named in ``security`` is missing or empty."""
    token = security.token()
    health_pool = futures.ThreadPoolExecutor(HEALTH_THREADS, thread_name_prefix="health")
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=limits.workers),
        interceptors=[
            *([TokenInterceptor(token)] if token else []),
            ErrorInterceptor(metrics, health_pool),
        ],
        options=_options(limits),
        maximum_concurrent_rpcs=limits.max_concurrent_rpcs,
    )
    health_servicer = health.HealthServicer()
    names = _add_health_and_reflection(server, health_servicer, service_names)
    set_serving(health_servicer, names, False)
    health_servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    return server, health_servicer


async def make_aio_server(
    limits: ServerLimits,
    service_names: Iterable[str],
    security: ServerSecurity = NO_SECURITY,
    metrics: ServiceMetrics | None = None,
) -> tuple[grpc.aio.Server, health.aio.HealthServicer]:
    """``make_server`` for asyncio: the same interceptors, limits, health (NOT_SERVING until
    told otherwise, see ``set_serving_aio``) and reflection. Call it on the event loop the
    server will run on; ``limits.workers`` does not apply (handlers are coroutines)."""
    token = security.token()
    server = grpc.aio.server(
        interceptors=[
            *([AioTokenInterceptor(token)] if token else []),
            AioErrorInterceptor(metrics),
        ],
        options=_options(limits),
        maximum_concurrent_rpcs=limits.max_concurrent_rpcs,
    )
    health_servicer = health.aio.HealthServicer()
    names = _add_health_and_reflection(server, health_servicer, service_names)
    await set_serving_aio(health_servicer, names, False)
    await health_servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    return server, health_servicer


def _serving(serving: bool) -> int:
    return (
        health_pb2.HealthCheckResponse.SERVING
        if serving
        else health_pb2.HealthCheckResponse.NOT_SERVING
    )


def set_serving(health_servicer: health.HealthServicer, names: Iterable[str], serving: bool):
    for name in ["", *names]:
        health_servicer.set(name, _serving(serving))


async def set_serving_aio(
    health_servicer: health.aio.HealthServicer, names: Iterable[str], serving: bool
) -> None:
    """``set_serving`` for the asyncio health servicer."""
    for name in ["", *names]:
        await health_servicer.set(name, _serving(serving))


def wait_for_termination(server: grpc.Server, grace_s: float, on_stop=None) -> None:
    """Block until SIGTERM or SIGINT, then stop accepting calls and let in-flight ones finish
    for up to ``grace_s`` seconds."""
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    stopping.wait()
    log.info("stopping: finishing in-flight calls (grace %.0f s)", grace_s)
    if on_stop is not None:
        on_stop()
    server.stop(grace_s).wait()
