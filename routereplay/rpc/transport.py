"""How the clients wait: each call is written once and made blocking or with asyncio.

A client (``client.py`` for the route cache, ``rollout_client.py``) builds each call's request
and names its ``Unary`` or ``Stream``: the stub's method, how a reply becomes a domain value,
and the retry rule. A transport makes the call: ``Blocking`` returns the value (an iterator for
a stream), ``AsyncIO`` an awaitable (an async iterator). Both retry UNAVAILABLE as the client's
``RetryPolicy`` says and raise every other failure as its domain error
(``routereplay.errors``), with the server's message.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc

from routereplay.errors import BY_STATUS, RETRY_AFTER_TRAILER, RouteReplayError


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
        its domain error when it is not retried (not UNAVAILABLE, or the last attempt)."""
        if exc.code() != grpc.StatusCode.UNAVAILABLE or attempt == self.attempts - 1:
            raise domain_error(exc) from None
        return self.backoff(attempt)


NO_RETRY = RetryPolicy(attempts=1)


def domain_error(exc: grpc.RpcError) -> RouteReplayError:
    """The domain exception for a failed call, with the server's message."""
    code = exc.code()
    cls = BY_STATUS.get(code.name if code else "", RouteReplayError)
    return cls(exc.details() or str(code), retry_after_s=_retry_after_s(exc))


def _retry_after_s(exc: grpc.RpcError) -> float | None:
    trailers = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == RETRY_AFTER_TRAILER:
            return int(value) / 1000
    return None


def _same(value):
    return value


def _unchanged(request) -> None:
    return None


@dataclass(frozen=True)
class Unary:
    """A call with one reply. ``reply`` makes it a domain value; ``before_retry`` changes the
    request for the next attempt (in place); ``retried``: False for calls that must not run
    twice."""

    method: str
    reply: Callable[[Any], Any] = _same
    before_retry: Callable[[Any], None] = _unchanged
    retried: bool = True


@dataclass(frozen=True)
class Stream:
    """A call with a stream of replies. ``parser()`` gives a function that turns each reply
    into a domain value or None (not complete yet), fresh for every attempt. A retried stream
    resumes: the request is asked again for what follows the values already delivered."""

    method: str
    parser: Callable[[], Callable[[Any], Any]]
    retried: bool = True


# A request: a message; or, for a call that streams its requests, a function that makes the
# stream anew (a retry sends it whole again). For a stream, a function of how many values were
# delivered (the resume rule).
Request = Any


def _request(request: Request, *args):
    return request(*args) if callable(request) else request


class _Transport:
    def __init__(self, stub, retry: RetryPolicy):
        self.stub, self.retry = stub, retry

    def _prepare(self, call: Unary | Stream):
        """The call's retry policy and the stub's method."""
        return (self.retry if call.retried else NO_RETRY), getattr(self.stub, call.method)


class Blocking(_Transport):
    """Makes the calls of a sync stub; waits by blocking."""

    def unary(self, call: Unary, request: Request, timeout: float | None, **kwargs):
        retry, method = self._prepare(call)
        for attempt in range(retry.attempts):
            message = _request(request)
            try:
                return call.reply(method(message, timeout=timeout, **kwargs))
            except grpc.RpcError as exc:
                pause = retry.pause_after(exc, attempt)
                call.before_retry(message)
                time.sleep(pause)

    def stream(self, call: Stream, request: Request, timeout: float | None) -> Iterator:
        retry, method = self._prepare(call)
        done = 0
        for attempt in range(retry.attempts):
            parse = call.parser()
            replies = method(_request(request, done), timeout=timeout)
            try:
                for reply in replies:
                    value = parse(reply)
                    if value is not None:
                        done += 1
                        yield value
                return
            except grpc.RpcError as exc:
                pause = retry.pause_after(exc, attempt)
            finally:
                replies.cancel()  # no-op after the end; stops the call if the caller went away
            time.sleep(pause)

    @staticmethod
    def first(values: Iterator):
        return next(values)


class AsyncIO(_Transport):
    """Makes the calls of a ``grpc.aio`` stub; waits with asyncio."""

    async def unary(self, call: Unary, request: Request, timeout: float | None, **kwargs):
        retry, method = self._prepare(call)
        for attempt in range(retry.attempts):
            message = _request(request)
            try:
                return call.reply(await method(message, timeout=timeout, **kwargs))
            except grpc.RpcError as exc:
                pause = retry.pause_after(exc, attempt)
                call.before_retry(message)
                await asyncio.sleep(pause)

    async def stream(self, call: Stream, request: Request, timeout: float | None) -> AsyncIterator:
        retry, method = self._prepare(call)
        done = 0
        for attempt in range(retry.attempts):
            parse = call.parser()
            replies = method(_request(request, done), timeout=timeout)
            try:
                async for reply in replies:
                    value = parse(reply)
                    if value is not None:
                        done += 1
                        yield value
                return
            except grpc.RpcError as exc:
                pause = retry.pause_after(exc, attempt)
            finally:
                replies.cancel()  # no-op after the end; stops the call if the caller went away
            await asyncio.sleep(pause)

    @staticmethod
    async def first(values: AsyncIterator):
        try:
            return await anext(values)
        finally:
            await values.aclose()
