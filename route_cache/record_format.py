"""How a record lies in Redis, and what is read back parsed into a record.

Storage format 3: a record is TWO keys in one slot (``{<sample_id>}`` is the Cluster
hash tag of both), committed together, expiring together:

``rr:{<sample_id>}``, a hash of the small fields:

    geometry        JSON of the geometry (and the storage format version)
    group           the group id
    rows, tokens    row and token counts (rows == tokens - 1)
    bytes           the length of the routes value (every block's route bytes)
    gen             a random id given at commit: a read checks that both keys were this
                    record's when it read them
    b@<row_start>   JSON descriptor of the block written at that row (turns, each layer
                    part's size and checksum, the tokens' checksum)
    t@<row_start>   its token ids (int32 LE) then its turns' log-probs (float32 LE)

``rr:{<sample_id>}:routes``, a string: every block's routes in row order, each block
layer-major (its MoE layers' parts back to back: raw ``[rows, k]`` ids, or one zstd frame per
layer; ``codec.LayerParts``). A block's place is the sum of the blocks before it; a layer
range of a block is one byte range.

So a write is one SET of the routes (into a staging key) and a small commit script, in one
round trip; a whole read one GET of the routes and one HGETALL of the small fields; a read of
a layer range (a pipeline stage) one GETRANGE per block, after the small fields (two round
trips per window of records, the second overlapping the sending of the previous window).
Each layer part keeps its own xxh3-64 checksum, verified by the reader.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field, replace

import numpy as np
import xxhash

from routereplay.domain.codec import EncodedRoutes, Encoding, LayerParts, contiguous, split_layers
from routereplay.domain.record import Geometry, Turn, check_layer_selection
from routereplay.errors import DataLoss, FailedPrecondition

FORMAT_VERSION = 3
# One hash per record, a field per MoE layer per block: read whole or by layer selection.
HASH_FORMAT_VERSION = 2
# One hash per record, one route field per block: read whole only.
OLD_FORMAT_VERSION = 1
LEGACY_FORMATS = (OLD_FORMAT_VERSION, HASH_FORMAT_VERSION)


@dataclass
class StoredBlock:
    """Rows ``[row_start, row_start + routes.num_rows)`` and the tokens that came with them:
    ``token_ids`` int32 ``[N]`` are tokens ``[token_start, token_start + N)`` of the record."""

    row_start: int
    token_start: int
    token_ids: np.ndarray
    turns: list[Turn]
    # Written: either form (the store splits a whole block into layers). Read: LayerParts of
    # the selected layers, or EncodedRoutes for a record in storage format 1.
    routes: EncodedRoutes | LayerParts
    # LayerParts' bytes back to back when the holder has them so: a received layer-major block
    # (the store sends it to Redis without joining its parts again), or a block read whole
    # (the server sends it in chunks without walking its parts).
    data: bytes | memoryview | None = None


@dataclass
class StoredRecord:
    """A record as read; ``layers``: the MoE layer selection it was read with (None: all)."""

    sample_id: str
    group_id: str
    geometry: Geometry
    blocks: list[StoredBlock] = field(default_factory=list)
    format: int = FORMAT_VERSION
    layers: tuple[int, ...] | None = None

    @property
    def num_rows(self) -> int:
        return sum(b.routes.num_rows for b in self.blocks)

    @property
    def route_bytes(self) -> int:
        """The route bytes held: the parts read (LayerParts), or whole blocks (format 1)."""
        return sum(
            sum(b.routes.sizes) if isinstance(b.routes, LayerParts) else len(b.routes.data)
            for b in self.blocks
        )

    @property
    def token_ids(self) -> np.ndarray:
        return np.concatenate([b.token_ids for b in self.blocks])

    @property
    def turns(self) -> list[Turn]:
        return [t for b in self.blocks for t in b.turns]


@dataclass
class RecordStat:
    """A record without its payload, and what it takes in Redis.

    Attributes:
        record: Its blocks carry no token ids, log-probs or route bytes.
        num_tokens: Tokens of the record.
        stored_bytes: Redis's own count for the whole key (``MEMORY USAGE``): route, token and
            log-prob bytes, descriptors, field names and the hash's overhead.
        ttl_ms: Until it expires; -1 when it never does.
        block_sizes: Per block (``record.blocks`` order), the bytes of each stored route part
            as encoded: one per MoE layer (storage formats 3 and 2), or one for the whole
            block (format 1).
    """

    record: StoredRecord
    num_tokens: int
    stored_bytes: int
    ttl_ms: int
    block_sizes: list[tuple[int, ...]] = field(default_factory=list)

    @property
    def route_bytes(self) -> int:
        """The record's route bytes as stored (encoded: RAW ids, or zstd frames)."""
        return sum(sum(sizes) for sizes in self.block_sizes)


def record_key(sample_id: str) -> str:
    return f"rr:{{{sample_id}}}"


def routes_key(sample_id: str) -> str:
    """The string of the record's route bytes (storage format 3), in its record's slot."""
    return f"rr:{{{sample_id}}}:routes"


def stream_tag(stream: str) -> str:
    """The part of the ready stream's key that Redis Cluster hashes: what is inside its first
    non-empty ``{...}``, else the whole key. Keys named ``{<tag>}...`` share its slot."""
    start = stream.find("{")
    end = stream.find("}", start + 1)
    return stream[start + 1 : end] if start >= 0 and end > start + 1 else stream


def settled_key(stream: str, sample_id: str) -> str:
    """The hash of which ready-feed entry settled the sample, per consumer group. In the
    stream's slot, so one script claims and acknowledges (``ReadyFeed.ack``): a failover of
    that master keeps both or loses both."""
    return f"{{{stream_tag(stream)}}}:settled:{sample_id}"


def freeing_key(stream: str) -> str:
    """The set of samples every commit group has settled whose records may not be freed yet
    (in the stream's slot: the claim script adds to it; ``ReadyFeed.free`` empties it)."""
    return f"{{{stream_tag(stream)}}}:freeing"


def dead_letter_key(stream: str) -> str:
    """The stream of samples announced and settled without training, with the reason (in the
    ready stream's slot: ``ReadyFeed.dead_letter``)."""
    return f"{{{stream_tag(stream)}}}:dead"


@functools.lru_cache(maxsize=64)  # every write and append needs it; a fleet has few models
def geometry_json(geometry: Geometry) -> str:
    return json.dumps(
        {
            "format": FORMAT_VERSION,
            "moe_layers": list(geometry.moe_layers),
            "topk": geometry.topk,
            "num_experts": geometry.num_experts,
            "model_id": geometry.model_id,
        },
        sort_keys=True,
        separators=(",", ":"),
    )


def old_format_message(sample_id: str, what: str, version: int = OLD_FORMAT_VERSION) -> str:
    layout = {
        OLD_FORMAT_VERSION: "one hash, one route field per block",
        HASH_FORMAT_VERSION: "one hash, one route field per MoE layer per block",
    }[version]
    return (
        f"record {sample_id!r} is in storage format {version} ({layout}, written by an "
        f"earlier release): it can be read but not {what}; it expires after the route "
        "cache's --ttl-s, or read it whole, delete it and write it again"
    )


class _Changed:
    """A read that found another record committed under its id while it read."""


CHANGED = _Changed()


def block_fields(block: StoredBlock, geometry: Geometry) -> tuple[str, bytes, bytes | memoryview]:
    """The block's descriptor (JSON), its token/log-prob bytes and its route bytes as stored
    (layer-major: every MoE layer's part back to back)."""
    tokens = np.asarray(block.token_ids, "<i4").tobytes() + b"".join(
        np.asarray(t.logprobs, "<f4").tobytes() for t in block.turns
    )
    parts = block.routes
    if isinstance(parts, EncodedRoutes):
        parts = split_layers(parts, geometry)
    value = block.data if block.data is not None else contiguous(parts)
    desc = {
        "row_start": block.row_start,
        "num_rows": parts.num_rows,
        "token_start": block.token_start,
        "num_tokens": int(block.token_ids.size),
        "encoding": parts.encoding.value,
        "parts": [[len(p), c] for p, c in zip(parts.parts, parts.checksums, strict=True)],
        "tokens_checksum": xxhash.xxh3_64_intdigest(tokens),
        "turns": [
            [t.token_start, t.token_end, t.generated_start, t.policy_version, t.logprobs.size]
            for t in block.turns
        ],
    }
    return json.dumps(desc, separators=(",", ":")), tokens, value


@dataclass
class Head:
    """A format-3 record's small fields: the record with its blocks' part sizes and
    checksums (no route bytes yet), where each block starts in the routes value, and the
    record's ``gen``."""

    record: StoredRecord
    offsets: list[int]
    sizes: list[tuple[int, ...]]
    gen: bytes | None
    ranges: dict = field(default_factory=dict)


def _geometry_of(fields: dict) -> tuple[Geometry, int]:
    return _parse_geometry(fields[b"geometry"])


@functools.lru_cache(maxsize=256)
def _parse_geometry(stored: bytes) -> tuple[Geometry, int]:
    """A stored geometry field and the storage format it names; cached, since every record
    of a model stores the same bytes and each read parses them twice (Geometry is frozen)."""
    geometry = json.loads(stored)
    return (
        Geometry(
            tuple(geometry["moe_layers"]),
            geometry["topk"],
            geometry["num_experts"],
            geometry["model_id"],
        ),
        geometry.get("format"),
    )


def parse_head(sample_id: str, fields: dict, payload: bool = True) -> Head:
    """The record in a format-3 hash, its routes as LayerParts of every layer whose parts
    are empty (the sizes and checksums are the descriptor's)."""
    geometry, _ = _geometry_of(fields)
    record = StoredRecord(sample_id, fields[b"group"].decode(), geometry)
    layers = tuple(range(geometry.num_moe_layers))
    offsets, all_sizes, offset = [], [], 0
    for row_start in _block_starts(fields):
        desc = json.loads(fields[b"b@%d" % row_start])
        token_ids, turns = _tokens_and_turns(sample_id, fields, row_start, desc, payload)
        sizes = tuple(size for size, _ in desc["parts"])
        routes = LayerParts(
            Encoding(desc["encoding"]),
            desc["num_rows"],
            layers,
            tuple(b"" for _ in sizes),
            tuple(c for _, c in desc["parts"]),
        )
        record.blocks.append(StoredBlock(row_start, desc["token_start"], token_ids, turns, routes))
        offsets.append(offset)
        all_sizes.append(sizes)
        offset += sum(sizes)
    return Head(record, offsets, all_sizes, fields.get(b"gen"))


def _block_starts(fields: dict) -> list[int]:
    """The first rows of a record's blocks, in order (each has a descriptor ``b@<row>``)."""
    return sorted(int(name[2:]) for name in fields if name.startswith(b"b@"))


def _tokens_and_turns(
    sample_id: str, fields: dict, row_start: int, desc: dict, payload: bool
) -> tuple[np.ndarray, list[Turn]]:
    turns = [Turn(ts, te, gs, pv) for ts, te, gs, pv, _ in desc["turns"]]
    if not payload:
        return np.zeros(0, np.int32), turns
    tokens = fields[b"t@%d" % row_start]
    if xxhash.xxh3_64_intdigest(tokens) != desc["tokens_checksum"]:
        raise DataLoss(f"record {sample_id!r}: token bytes of block {row_start} corrupt")
    n_tokens = desc["num_tokens"]
    token_ids = np.frombuffer(tokens, "<i4", count=n_tokens)
    offset = 4 * n_tokens
    for turn, (*_, n_logprobs) in zip(turns, desc["turns"], strict=True):
        turn.logprobs = np.frombuffer(tokens, "<f4", count=n_logprobs, offset=offset)
        offset += 4 * n_logprobs
    return token_ids, turns


def _part_views(sizes: tuple[int, ...], data: memoryview) -> tuple[memoryview, ...]:
    """Parts of ``sizes`` cut from ``data``, their bytes back to back."""
    views, offset = [], 0
    for size in sizes:
        views.append(data[offset : offset + size])
        offset += size
    return tuple(views)


def whole_record(sample_id: str, gen, value, fields: dict):
    """The record a whole read found: ``gen`` before, the routes value, the small fields
    after. None when there is none (or it expired meanwhile); ``CHANGED`` when another
    record was committed under the id while it was read."""
    if not fields or fields.get(b"geometry") is None:
        return None
    _, version = _geometry_of(fields)
    if version in LEGACY_FORMATS:
        return _parse_legacy(sample_id, fields)
    if gen != fields.get(b"gen"):
        return CHANGED
    if value is None:  # expired a moment before the small fields
        return None
    head = parse_head(sample_id, fields)
    view, blocks = memoryview(value), []
    for block, offset, sizes in zip(head.record.blocks, head.offsets, head.sizes, strict=True):
        end = offset + sum(sizes)
        if end > len(view):  # appended after the routes were read: not in this read
            break
        block.data = view[offset:end]
        block.routes = replace(block.routes, parts=_part_views(sizes, block.data))
        blocks.append(block)
    held = sum(sum(b.routes.sizes) for b in blocks)
    if held != len(view):
        raise DataLoss(
            f"record {sample_id!r}: its routes hold {len(view)} bytes; its blocks describe {held}"
        )
    head.record.blocks = blocks
    return head.record


def stage_head(sample_id: str, fields: dict, layers: tuple[int, ...]):
    """A stage read's first step: the record's small fields (None: no record). A record in
    an older format comes back whole from this step, its selection taken from it."""
    if not fields or fields.get(b"geometry") is None:
        return None
    geometry, version = _geometry_of(fields)
    if version in LEGACY_FORMATS:
        return _parse_legacy(sample_id, fields, layers=layers)
    check_layer_selection(layers, geometry.num_moe_layers, "layers.indices")
    return parse_head(sample_id, fields)


def _runs(layers: tuple[int, ...]) -> list[tuple[int, int]]:
    """Runs of consecutive layer indices, as ``[first, last + 1)``."""
    runs = []
    for layer in layers:
        if runs and runs[-1][1] == layer:
            runs[-1][1] = layer + 1
        else:
            runs.append([layer, layer + 1])
    return [tuple(run) for run in runs]


def stage_ranges(head: Head, layers: tuple[int, ...]) -> list[tuple[int, int]]:
    """The byte ranges ``[start, end)`` of the routes value a selection reads: one per run of
    consecutive layers per block (empty ones left out: GETRANGE cannot ask for nothing)."""
    if layers not in head.ranges:
        ranges = []
        for offset, sizes in zip(head.offsets, head.sizes, strict=True):
            starts = np.cumsum((0, *sizes)).tolist()
            for first, stop in _runs(layers):
                start, end = offset + starts[first], offset + starts[stop]
                if end > start:
                    ranges.append((start, end))
        head.ranges[layers] = ranges
    return head.ranges[layers]


def stage_record(head: Head, layers: tuple[int, ...], ranges: list[bytes], gen):
    """A stage read's record from its ranges; None when it went away meanwhile,
    ``CHANGED`` when another record was committed under its id."""
    if gen != head.gen:
        return None if gen is None else CHANGED
    expected = stage_ranges(head, layers)
    if any(len(got) != end - start for got, (start, end) in zip(ranges, expected, strict=True)):
        return None  # the routes expired a moment before the small fields
    got = iter(ranges)
    record = head.record
    record.layers = layers
    runs = _runs(layers)
    for block, sizes in zip(record.blocks, head.sizes, strict=True):
        parts = []
        for first, stop in runs:
            size = sum(sizes[first:stop])
            view = memoryview(next(got)) if size else memoryview(b"")
            offset = 0
            for j in range(first, stop):
                parts.append(view[offset : offset + sizes[j]])
                offset += sizes[j]
        if len(runs) == 1:  # a stage: the selected parts are one range, back to back
            block.data = view
        checksums = tuple(block.routes.checksums[j] for j in layers)
        block.routes = LayerParts(
            block.routes.encoding, block.routes.num_rows, layers, tuple(parts), checksums
        )
    return record


def _legacy_stat(sample_id: str, fields: dict, usage: int, ttl: int) -> RecordStat:
    """StatRecord of a record in storage format 1 or 2 (one hash, fetched whole)."""
    record = _parse_legacy(sample_id, fields, payload=False)
    block_sizes = []
    for block in record.blocks:
        if record.format == OLD_FORMAT_VERSION:
            block_sizes.append((len(fields.get(b"r@%d" % block.row_start, b"")),))
        else:
            names = [b"r@%d:%d" % (block.row_start, j) for j in block.routes.layers]
            block_sizes.append(tuple(len(fields.get(name, b"")) for name in names))
    return RecordStat(record, int(fields[b"tokens"]), usage, ttl, block_sizes)


def _parse_legacy(
    sample_id: str, fields: dict, payload: bool = True, layers: tuple[int, ...] | None = None
) -> StoredRecord:
    """The record in ``fields`` (a hash's fields; with ``layers``, only those layers' route
    parts among them)."""
    geometry, version = _geometry_of(fields)
    if version not in LEGACY_FORMATS:
        raise DataLoss(f"record {sample_id!r} has storage format {version}")
    if layers is not None and version == OLD_FORMAT_VERSION:
        raise FailedPrecondition(old_format_message(sample_id, "read by layer selection"))
    record = StoredRecord(
        sample_id,
        fields[b"group"].decode(),
        geometry,
        format=version,
        layers=layers,
    )
    if layers is not None:
        check_layer_selection(layers, record.geometry.num_moe_layers, "layers.indices")
    selected = layers or tuple(range(record.geometry.num_moe_layers))
    for row_start in _block_starts(fields):
        desc = json.loads(fields[b"b@%d" % row_start])
        token_ids, turns = _tokens_and_turns(sample_id, fields, row_start, desc, payload)
        encoding, rows = Encoding(desc["encoding"]), desc["num_rows"]
        if version == OLD_FORMAT_VERSION:
            data = fields[b"r@%d" % row_start] if payload else b""
            routes = EncodedRoutes(encoding, data, desc["checksum"], rows)
        else:
            parts = tuple(
                fields.get(b"r@%d:%d" % (row_start, j), b"") if payload else b"" for j in selected
            )
            checksums = tuple(desc["parts"][j][1] for j in selected)
            routes = LayerParts(encoding, rows, selected, parts, checksums)
        record.blocks.append(StoredBlock(row_start, desc["token_start"], token_ids, turns, routes))
    return record


def stat_record(sample_id: str, fields: dict, usage: int, ttl: int) -> RecordStat:
    """StatRecord of the record in ``fields`` (its small fields, or a legacy hash) that
    takes ``usage`` bytes in Redis."""
    _, version = _geometry_of(fields)
    if version in LEGACY_FORMATS:
        return _legacy_stat(sample_id, fields, usage, ttl)
    head = parse_head(sample_id, fields, payload=False)
    return RecordStat(head.record, int(fields[b"tokens"]), usage, ttl, head.sizes)


def stored_format(geometry: bytes | None) -> int | None:
    """The storage format named by a record's stored geometry JSON (None: no record)."""
    return None if geometry is None else json.loads(geometry).get("format")
