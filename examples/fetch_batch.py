"""Fetch a batch of records from the route cache with nothing but the generated stubs.

This is what a trainer written in another framework does: it needs the protos in
``proto/routereplay/v1`` (compiled for its own language), gRPC, numpy, zstd and xxh3 -- not
this project's Python package. Run it against a route cache::

    python examples/fetch_batch.py --target localhost:50051 sample-0 sample-1

It prints each record's geometry, tokens, turns and routes ``[rows, moe_layers, topk]``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import grpc
import numpy as np
import xxhash
import zstandard

from routereplay.v1 import record_pb2, route_cache_pb2, route_cache_pb2_grpc

DTYPES = {
    record_pb2.ROUTE_DTYPE_UINT8: np.dtype("u1"),
    record_pb2.ROUTE_DTYPE_UINT16: np.dtype("<u2"),
}


@dataclass
class FetchedRecord:
    info: route_cache_pb2.RecordInfo
    # One growing buffer per RouteBlock of info.blocks.
    encoded: list[bytearray] = field(default_factory=list)

    @property
    def token_ids(self) -> np.ndarray:
        return np.frombuffer(self.info.token_ids, "<i4")

    def routes(self) -> np.ndarray:
        """Row i holds the experts chosen when token i was the input: ``[rows, layers, topk]``."""
        parts = [
            decode_block(b, bytes(data), self.info.geometry)
            for b, data in zip(self.info.blocks, self.encoded, strict=True)
        ]
        return np.concatenate(parts) if parts else np.empty((0, 0, 0), "u1")


def decode_block(block, data: bytes, geometry) -> np.ndarray:
    if len(data) != block.encoded_size or xxhash.xxh3_64_intdigest(data) != block.checksum:
        raise ValueError(f"route block at row {block.row_start}: size or checksum mismatch")
    dtype = DTYPES[block.dtype]
    layers, topk = len(geometry.moe_layers), geometry.topk
    if block.encoding == record_pb2.ENCODING_RAW:
        return np.frombuffer(data, dtype).reshape(block.num_rows, layers, topk)
    # ENCODING_ZSTD: the frame sizes (uint32 LE), then one frame per layer of [rows, topk].
    sizes = np.frombuffer(data, "<u4", count=layers)
    out = np.empty((block.num_rows, layers, topk), dtype)
    start = 4 * layers
    for layer, size in enumerate(sizes):
        frame = zstandard.ZstdDecompressor().decompress(data[start : start + int(size)])
        out[:, layer] = np.frombuffer(frame, dtype).reshape(block.num_rows, topk)
        start += int(size)
    return out


def fetch_batch(
    channel: grpc.Channel, sample_ids: list[str], metadata=()
) -> dict[str, FetchedRecord | None]:
    """The records of ``sample_ids`` in one server stream (None for an id the cache lacks)."""
    stub = route_cache_pb2_grpc.RouteCacheStub(channel)
    request = route_cache_pb2.ReadBatchRequest(sample_ids=sample_ids, skip_missing=True)
    fetched: dict[str, FetchedRecord | None] = {}
    current = None
    for part in stub.ReadBatch(request, timeout=60, metadata=metadata):
        kind = part.WhichOneof("part")
        if kind == "record":
            current = FetchedRecord(part.record, [bytearray() for _ in part.record.blocks])
            fetched[part.record.sample_id] = current
        elif kind == "chunk":
            # Chunks of a record follow its header, each block's in offset order.
            current.encoded[part.chunk.block] += part.chunk.data
        else:
            fetched[part.missing_sample_id] = None
    return fetched


def open_channel(target: str, ca_file: str | None) -> grpc.Channel:
    # Route blocks are large: allow messages as big as the server's chunks.
    options = [("grpc.max_receive_message_length", 64 << 20)]
    if ca_file is None:
        return grpc.insecure_channel(target, options=options)
    with open(ca_file, "rb") as f:
        credentials = grpc.ssl_channel_credentials(root_certificates=f.read())
    return grpc.secure_channel(target, credentials, options=options)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="localhost:50051", help="route cache host:port")
    parser.add_argument("--ca-file", help="PEM CA bundle: connect with TLS")
    parser.add_argument("--token-file", help="file holding the bearer token the server expects")
    parser.add_argument("sample_ids", nargs="+")
    args = parser.parse_args()
    metadata = ()
    if args.token_file:
        with open(args.token_file) as f:
            metadata = (("authorization", f"Bearer {f.read().strip()}"),)
    with open_channel(args.target, args.ca_file) as channel:
        for sample_id, record in fetch_batch(channel, args.sample_ids, metadata).items():
            if record is None:
                print(f"{sample_id}: not in the cache")
                continue
            routes, geometry = record.routes(), record.info.geometry
            turns = [(t.token_start, t.token_end, t.policy_version) for t in record.info.turns]
            print(
                f"{sample_id}: {record.token_ids.size} tokens, turns {turns}, "
                f"MoE layers {list(geometry.moe_layers)}, top-{geometry.topk} of "
                f"{geometry.num_experts}, routes {routes.shape} {routes.dtype}, "
                f"first row {routes[0].tolist() if len(routes) else []}"
            )


if __name__ == "__main__":
    main()
