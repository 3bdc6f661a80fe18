"""A trivial bytes-in/bytes-out streaming gRPC service: the transport floor of the route cache.

Built with the route cache's own server plumbing (``make_server``: the same interceptor,
limits, HTTP/2 transport options and health service) and no protobuf: messages are raw
bytes. ``Write`` streams chunks in and keeps them under the key sent in the call's metadata;
``ReadBatch`` takes newline-separated keys and streams every stored chunk back, or with a
``range`` in its metadata (``start:stop``) only those bytes of each value (a pipeline stage's
share, as a layer-selected read of a layer-major record moves). No checks, no copies beyond
what gRPC itself does: what the route cache adds on top of this is its own cost.

Two floors: chunks kept in memory (the transport alone), or, with ``--redis-url``, joined and
SET in Redis on write and each key's value fetched with GET (GETRANGE for a range) and sent
back in the same chunks on read, the next key's fetch overlapping this one's sending as the
route cache's batch reads do (the transport and Redis: what any route cache built on these two
pays).

``python -m benchmarks.performance.raw_grpc --host H --port P [--redis-url URL]`` serves until
SIGTERM;
``RawClient`` is its client.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from route_cache.connection import connect
from routereplay.allocator import keep_large_buffers
from routereplay.rpc.chunks import DEFAULT_CHUNK_BYTES
from routereplay.rpc.grpc_server import (
    ServerLimits,
    channel_options,
    make_server,
    set_serving,
    wait_for_termination,
)

SERVICE = "bench.RawBytes"
WRITE = f"/{SERVICE}/Write"
READ_BATCH = f"/{SERVICE}/ReadBatch"


class RawStore:
    """Chunks by key, in memory."""

    def __init__(self):
        self.chunks: dict[bytes, list[bytes]] = {}

    def write(self, request_iterator: Iterator[bytes], context) -> bytes:
        key = dict(context.invocation_metadata())["key"].encode()
        chunks = list(request_iterator)
        self.chunks[key] = chunks
        return sum(len(c) for c in chunks).to_bytes(8, "little")

    def read_batch(self, request: bytes, context) -> Iterator[bytes]:
        span = _byte_range(context)
        for key in request.split(b"\n"):
            if span is None:
                yield from self.chunks[key]
            else:
                yield b"".join(self.chunks[key])[span]


class RedisRawStore:
    """Chunks by key, joined into one Redis value; the route cache's socket read size."""

    def __init__(self, url: str, chunk_bytes: int = DEFAULT_CHUNK_BYTES):
        self.client = connect(url, cluster=False)
        self.chunk_bytes = chunk_bytes

    def write(self, request_iterator: Iterator[bytes], context) -> bytes:
        key = "raw-grpc:" + dict(context.invocation_metadata())["key"]
        data = b"".join(request_iterator)
        self.client.set(key, data)
        return len(data).to_bytes(8, "little")

    def read_batch(self, request: bytes, context) -> Iterator[bytes]:
        keys = ["raw-grpc:" + k.decode() for k in request.split(b"\n")]
        span = _byte_range(context)

        def fetch(key: str) -> bytes:
            if span is None:
                return self.client.get(key)
            return self.client.getrange(key, span.start, span.stop - 1)

        with ThreadPoolExecutor(max_workers=1) as prefetch:
            pending = prefetch.submit(fetch, keys[0])
            for i in range(len(keys)):
                view = memoryview(pending.result())
                if i + 1 < len(keys):
                    pending = prefetch.submit(fetch, keys[i + 1])
                for offset in range(0, len(view), self.chunk_bytes):
                    yield bytes(view[offset : offset + self.chunk_bytes])


def _byte_range(context) -> slice | None:
    """The call's ``range`` metadata (``start:stop``, bytes of each value), or None."""
    text = dict(context.invocation_metadata()).get("range")
    if text is None:
        return None
    start, stop = map(int, text.split(":"))
    return slice(start, stop)


def serve(host: str, port: int, redis_url: str = "") -> None:
    server, health = make_server(ServerLimits(), [SERVICE])
    store = RedisRawStore(redis_url) if redis_url else RawStore()
    handlers = {
        "Write": grpc.stream_unary_rpc_method_handler(store.write),
        "ReadBatch": grpc.unary_stream_rpc_method_handler(store.read_batch),
    }
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
    server.add_insecure_port(f"{host}:{port}")
    server.start()
    set_serving(health, [SERVICE], True)
    wait_for_termination(server, grace_s=1)


class RawClient:
    """Client of the raw service, over a channel with the route cache client's options."""

    def __init__(self, target: str):
        self.channel = grpc.insecure_channel(target, options=channel_options())
        self._write = self.channel.stream_unary(WRITE)
        self._write_one = self.channel.unary_unary(WRITE)  # as the route cache client does
        self._read = self.channel.unary_stream(READ_BATCH)

    def write(self, key: str, chunks: Iterable[bytes]) -> int:
        """Streams ``chunks`` under ``key`` (one chunk: a unary call of the same method);
        returns the bytes the server received."""
        chunks = list(chunks)
        if len(chunks) == 1:
            reply = self._write_one(chunks[0], metadata=[("key", key)], timeout=120)
        else:
            reply = self._write(iter(chunks), metadata=[("key", key)], timeout=120)
        return int.from_bytes(reply, "little")

    def read_batch(
        self, keys: Iterable[str], byte_range: tuple[int, int] | None = None
    ) -> Iterator[bytes]:
        """Every chunk stored under ``keys``, in order; with ``byte_range`` (start, stop) only
        those bytes of each value."""
        metadata = None if byte_range is None else [("range", "{}:{}".format(*byte_range))]
        return self._read("\n".join(keys).encode(), metadata=metadata, timeout=120)

    def close(self) -> None:
        self.channel.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--redis-url", default="", help="keep the bytes in this Redis")
    args = parser.parse_args(argv)
    keep_large_buffers()  # as the route cache does: the same process setup
    serve(args.host, args.port, args.redis_url)
    return 0


if __name__ == "__main__":
    sys.exit(main())
