"""A trivial bytes-in/bytes-out streaming gRPC service: the transport floor of the route cache.

Built with the route cache's own server plumbing (``make_server``: the same interceptor,
limits, HTTP/2 transport options and health service) and no protobuf: messages are raw
bytes. ``Write`` streams chunks in and keeps them in memory under the key sent in the call's
metadata; ``ReadBatch`` takes newline-separated keys and streams every stored chunk back. No
checks, no copies beyond what gRPC itself does: what the route cache adds on top of this is
its own cost.

``python -m benchmarks.raw_grpc --host H --port P`` serves until SIGTERM;
``RawClient`` is its client.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable, Iterator

import grpc

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
        for key in request.split(b"\n"):
            yield from self.chunks[key]


def serve(host: str, port: int) -> None:
    server, health = make_server(ServerLimits(), [SERVICE])
    store = RawStore()
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
        self._read = self.channel.unary_stream(READ_BATCH)

    def write(self, key: str, chunks: Iterable[bytes]) -> int:
        """Streams ``chunks`` under ``key``; returns the bytes the server received."""
        reply = self._write(iter(chunks), metadata=[("key", key)], timeout=120)
        return int.from_bytes(reply, "little")

    def read_batch(self, keys: Iterable[str]) -> Iterator[bytes]:
        """Every chunk stored under ``keys``, in order."""
        return self._read("\n".join(keys).encode(), timeout=120)

    def close(self) -> None:
        self.channel.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args(argv)
    serve(args.host, args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
