"""Transport security and authentication of the gRPC services: TLS (mutual TLS on request),
and a shared bearer token checked by a server interceptor.

Secrets (keys, tokens) are read from files when a server or channel is built, or a token from
an environment variable; configurations hold paths, hide tokens from their repr, and no
message or log line ever carries a secret. The gRPC health service answers without a token,
so orchestrators' probes keep working; everything else, reflection included, needs it.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from routereplay.rpc.service_config import flag

HEALTH_PREFIX = "/grpc.health.v1.Health/"
# A secret field: read from its environment variable only, never a flag (flags show in ps).
ENV_ONLY = {"env_only": True}


def read_secret(path: str, what: str) -> bytes:
    """A secret file's bytes, trailing whitespace dropped (editors add a newline).

    Raises:
        ValueError: the file is missing, unreadable or empty (naming the path, not the bytes).
    """
    try:
        data = Path(path).read_bytes().rstrip()
    except OSError as exc:
        raise ValueError(f"cannot read {what} {path!r}: {exc.strerror}") from None
    if not data:
        raise ValueError(f"{what} {path!r} is empty")
    return data


def _token(token: str, token_file: str, what: str) -> bytes | None:
    if token and token_file:
        raise ValueError(f"set the {what} or its file, not both")
    if token_file:
        return read_secret(token_file, f"{what} file")
    return token.encode() or None


@dataclass(frozen=True)
class ServerSecurity:
    """TLS and authentication of one gRPC server (see the fields' help). Everything empty:
    plaintext, no token. ``auth_token`` is the token from the environment (never a flag, never
    in repr); calls send it as ``authorization: Bearer <token>``."""

    tls_cert_file: str = flag(
        "", "PEM certificate chain of this server; with tls_key_file: TLS only"
    )
    tls_key_file: str = flag("", "PEM private key of this server")
    tls_client_ca_file: str = flag(
        "", "PEM CA of client certificates: mutual TLS (needs tls_cert_file)"
    )
    auth_token_file: str = flag(
        "", "file holding the bearer token calls must send (health needs none)"
    )
    auth_token: str = field(default="", repr=False, metadata=ENV_ONLY)

    def __post_init__(self):
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together: set both or neither")
        if self.tls_client_ca_file and not self.tls_cert_file:
            raise ValueError("tls_client_ca_file (mutual TLS) needs tls_cert_file and tls_key_file")
        if self.auth_token and self.auth_token_file:
            raise ValueError("set auth_token or auth_token_file, not both")

    def credentials(self) -> grpc.ServerCredentials | None:
        """The TLS credentials, read from the files now; None for plaintext."""
        if not self.tls_cert_file:
            return None
        key = read_secret(self.tls_key_file, "tls_key_file")
        cert = read_secret(self.tls_cert_file, "tls_cert_file")
        ca = None
        if self.tls_client_ca_file:
            ca = read_secret(self.tls_client_ca_file, "tls_client_ca_file")
        return grpc.ssl_server_credentials([(key, cert)], ca, require_client_auth=ca is not None)

    def token(self) -> bytes | None:
        return _token(self.auth_token, self.auth_token_file, "auth_token")


@dataclass(frozen=True)
class ClientSecurity:
    """How a client reaches a server (see the fields' help). Everything empty: plaintext, no
    token. ``token`` is the token from the environment (never a flag, never in repr)."""

    tls: bool = flag(False, "speak TLS (the system's roots unless ca_file is set)")
    ca_file: str = flag("", "PEM CA that signed the server's certificate (turns TLS on)")
    cert_file: str = flag("", "PEM client certificate, for mutual TLS")
    key_file: str = flag("", "PEM client private key, for mutual TLS")
    token_file: str = flag("", "file holding the bearer token to send")
    token: str = field(default="", repr=False, metadata=ENV_ONLY)

    def __post_init__(self):
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("cert_file and key_file go together: set both or neither")
        if self.token and self.token_file:
            raise ValueError("set token or token_file, not both")

    @property
    def uses_tls(self) -> bool:
        return self.tls or bool(self.ca_file or self.cert_file)

    def credentials(self) -> grpc.ChannelCredentials | None:
        """The TLS credentials, read from the files now; None for plaintext."""
        if not self.uses_tls:
            return None
        ca = read_secret(self.ca_file, "ca_file") if self.ca_file else None
        key = read_secret(self.key_file, "key_file") if self.key_file else None
        cert = read_secret(self.cert_file, "cert_file") if self.cert_file else None
        return grpc.ssl_channel_credentials(ca, key, cert)

    def metadata(self) -> tuple[tuple[str, str], ...]:
        token = _token(self.token, self.token_file, "token")
        return (("authorization", f"Bearer {token.decode()}"),) if token else ()


PLAINTEXT = ClientSecurity()


def add_port(server, address: str, security: ServerSecurity) -> int:
    """Listen on ``address`` with TLS when ``security`` has a certificate; returns the port.
    Works for thread-pool and asyncio servers alike."""
    credentials = security.credentials()
    if credentials is None:
        return server.add_insecure_port(address)
    return server.add_secure_port(address, credentials)


# --- the client side: the token as metadata on every call ---------------------------------


class _Details(grpc.ClientCallDetails):
    def __init__(self, details, metadata):
        self.method = details.method
        self.timeout = details.timeout
        self.credentials = details.credentials
        self.wait_for_ready = getattr(details, "wait_for_ready", None)
        self.compression = getattr(details, "compression", None)
        self.metadata = [*(details.metadata or ()), *metadata]


class _TokenClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    # The token travels as plain metadata rather than call credentials, which gRPC only allows
    # on TLS channels: a plaintext deployment inside a private network may still use a token.
    def __init__(self, metadata):
        self._metadata = metadata

    def _call(self, continuation, details, request):
        return continuation(_Details(details, self._metadata), request)

    intercept_unary_unary = intercept_unary_stream = _call
    intercept_stream_unary = intercept_stream_stream = _call


class _AioToken:
    def __init__(self, metadata):
        self._metadata = metadata

    async def _call(self, continuation, details, request):
        metadata = grpc.aio.Metadata(*(details.metadata or ()), *self._metadata)
        return await continuation(details._replace(metadata=metadata), request)


# An asyncio channel files each interceptor under its first matching kind: one class per kind.
class _AioTokenUnaryUnary(_AioToken, grpc.aio.UnaryUnaryClientInterceptor):
    intercept_unary_unary = _AioToken._call


class _AioTokenUnaryStream(_AioToken, grpc.aio.UnaryStreamClientInterceptor):
    intercept_unary_stream = _AioToken._call


class _AioTokenStreamUnary(_AioToken, grpc.aio.StreamUnaryClientInterceptor):
    intercept_stream_unary = _AioToken._call


class _AioTokenStreamStream(_AioToken, grpc.aio.StreamStreamClientInterceptor):
    intercept_stream_stream = _AioToken._call


_AIO_TOKEN_KINDS = (
    _AioTokenUnaryUnary,
    _AioTokenUnaryStream,
    _AioTokenStreamUnary,
    _AioTokenStreamStream,
)


def secure_channel(target: str, security: ClientSecurity = PLAINTEXT, options=()) -> grpc.Channel:
    """A blocking channel to ``target`` with ``security``'s TLS and token."""
    credentials = security.credentials()
    if credentials is None:
        channel = grpc.insecure_channel(target, options=options)
    else:
        channel = grpc.secure_channel(target, credentials, options=options)
    metadata = security.metadata()
    if not metadata:
        return channel
    return grpc.intercept_channel(channel, _TokenClientInterceptor(metadata))


def secure_aio_channel(
    target: str, security: ClientSecurity = PLAINTEXT, options=()
) -> grpc.aio.Channel:
    """``secure_channel`` for asyncio."""
    credentials = security.credentials()
    metadata = security.metadata()
    interceptors = [kind(metadata) for kind in _AIO_TOKEN_KINDS] if metadata else None
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
    return grpc.aio.secure_channel(target, credentials, options=options, interceptors=interceptors)


# --- the server side: the token check --------------------------------------------------------

MISSING_TOKEN = "missing bearer token: send the metadata 'authorization: Bearer <token>'"
WRONG_TOKEN = "the bearer token is wrong"


def _token_problem(token: bytes, handler_call_details) -> str | None:
    """Why the call may not run, or None. Health checks need no token."""
    if handler_call_details.method.startswith(HEALTH_PREFIX):
        return None
    sent = [v for k, v in handler_call_details.invocation_metadata or () if k == "authorization"]
    if not sent:
        return MISSING_TOKEN
    value = sent[0].encode() if isinstance(sent[0], str) else sent[0]
    scheme, _, given = value.partition(b" ")
    # compare_digest's time does not depend on where the tokens differ.
    if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), token):
        return WRONG_TOKEN
    return None


_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


def _refuse_with(handler, refuse):
    kind = next(k for k in _KINDS if getattr(handler, k) is not None)
    return handler._replace(**{kind: refuse})


class TokenInterceptor(grpc.ServerInterceptor):
    """Answers UNAUTHENTICATED to calls without the right bearer token (health checks pass)."""

    def __init__(self, token: bytes):
        self._token = token

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        problem = _token_problem(self._token, handler_call_details)
        if handler is None or problem is None:
            return handler

        def refuse(request, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)

        return _refuse_with(handler, refuse)


class AioTokenInterceptor(grpc.aio.ServerInterceptor):
    """``TokenInterceptor`` for asyncio servers."""

    def __init__(self, token: bytes):
        self._token = token

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        problem = _token_problem(self._token, handler_call_details)
        if handler is None or problem is None:
            return handler

        async def refuse(request, context):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, problem)

        return _refuse_with(handler, refuse)
