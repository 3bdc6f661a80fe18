"""Sizing the route cache's Redis before a run, from a checkpoint's ``config.json``.

Route bytes: each of a sample's ``T - 1`` rows holds top-k expert ids for every MoE layer,
1 byte each up to 256 experts, else 2 (``routereplay.domain.record.route_dtype``).

What Redis holds per record (storage format 3, ``route_cache/record_format.py``; one block,
as a single-turn sample is written):

- the routes string: the route bytes (RAW, as the rollout server writes them);
- the record's hash: ``t@0``, the token ids (int32, 4 bytes a token) then the log-probs of the
  generated tokens when they were asked for (float32, 4 bytes each); ``b@0``, the block's
  JSON descriptor (about 30 bytes per MoE layer: each layer part's size and checksum);
  ``geometry``, the geometry JSON; and the small fields (group, rows, tokens, bytes, gen);
- the sample's settled hash (one consumer group's claim) and its ready-stream entry.

Each value is one allocation, which the allocator rounds up to its size class (jemalloc,
Redis's default on Linux: 4 classes per power of two, so up to 25% on one value); the keys,
small fields, hash and dict entries, expiry entries, the claim and the stream entry are a
fixed ``RECORD_OVERHEAD``, measured (see there).

Records in flight, which Redis must hold at once:
``(steps ahead of the trainer + checkpoint interval + the step being trained) x samples per
step``: a record is freed once the checkpoint covering the step that trained it commits it.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from routereplay.domain.record import Geometry, route_dtype
from routereplay.families.model_geometry import geometry_from_config

# Redis's own bytes per record beyond the allocations of its routes, token bytes, geometry
# JSON and descriptor (those are counted and rounded apart): 3 keys (hash, routes, settled)
# with their dict and expiry entries and objects, the hash's table, small fields and field
# names, one consumer group's claim and the ready-stream entry. Measured as INFO memory's
# used_memory growth per record, less those allocations, over records written through the
# route cache's gRPC service and acknowledged by one consumer group, with 35-character sample
# ids and 22-character group ids (tests/routereplay/test_sizing.py repeats it): Redis 7.0.15
# (jemalloc 5.3.0) 1010-1260 bytes over 2 to 4096 tokens and 8 to 48 MoE layers, mostly
# 1150; Valkey 9.1.2 (libc malloc) 950-1170.
RECORD_OVERHEAD = 1152
# Redis's used_memory without records: 0.9 MB at start (Redis 7.0), 1.5 MB once the route
# cache has written and acknowledged (its connections, scripts, the stream and its group).
REDIS_BASE_BYTES = 2 << 20
TOKEN_ID_BYTES = 4  # int32
LOGPROB_BYTES = 4  # float32
ALLOCATORS = ("jemalloc", "libc")
# The route cache's --memory-budget default: writes are refused once a node's used_memory
# reaches this share of its maxmemory.
MEMORY_BUDGET = 0.9
# The descriptor's checksums (xxh3-64) at their widest: 20 digits.
_CHECKSUM = 2**64 - 1
_FORMAT_VERSION = 3  # route_cache.record_format.FORMAT_VERSION; the tests compare the two


@dataclass(frozen=True)
class Run:
    """A run's shape.

    Attributes:
        tokens: Tokens per sample (prompt and generated).
        samples_per_step: Samples one training step consumes.
        steps_ahead: Steps the rollouts run ahead of the trainer (0: synchronous).
        checkpoint_interval: Steps between checkpoints: a record is freed only once a
            checkpoint covers the step that trained it.
        logprob_tokens: Generated tokens per sample whose log-probs are stored (0: none asked).
    """

    tokens: int
    samples_per_step: int
    steps_ahead: int = 1
    checkpoint_interval: int = 1
    logprob_tokens: int = 0

    def __post_init__(self):
        if self.tokens < 2:
            raise ValueError(f"a sample has at least 2 tokens (one route row), got {self.tokens}")
        if self.samples_per_step < 1:
            raise ValueError(f"samples per step must be >= 1, got {self.samples_per_step}")
        if self.steps_ahead < 0 or self.checkpoint_interval < 1:
            raise ValueError(
                f"steps ahead must be >= 0 and the checkpoint interval >= 1, got "
                f"{self.steps_ahead} and {self.checkpoint_interval}"
            )
        if not 0 <= self.logprob_tokens <= self.tokens:
            raise ValueError(f"logprob tokens must be in [0, {self.tokens}]")

    @property
    def steps_in_flight(self) -> int:
        return self.steps_ahead + self.checkpoint_interval + 1


@dataclass(frozen=True)
class RecordSize:
    """One record's bytes: its payload as stored, and what Redis takes for it in all."""

    route_bytes: int
    token_bytes: int  # token ids and log-probs
    small_bytes: int  # the geometry JSON and the block descriptor
    redis_bytes: int


def id_bytes(geometry: Geometry) -> int:
    """Bytes per stored expert id: 1 up to 256 experts, else 2."""
    return route_dtype(geometry.num_experts).itemsize


def route_bytes_per_token(geometry: Geometry) -> int:
    return geometry.num_moe_layers * geometry.topk * id_bytes(geometry)


def allocated(n: int, allocator: str = "jemalloc") -> int:
    """Bytes an allocator hands out for an ``n``-byte Redis string (its sds header and
    terminator added)."""
    n += (3 if n < 2**8 else 5 if n < 2**16 else 9) + 1
    if allocator == "libc":  # glibc: 16-byte chunks; large ones are pages (under 1% off)
        return max(24, -(-(n + 8) // 16) * 16 - 8)
    if allocator != "jemalloc":
        raise ValueError(f"allocator {allocator!r}: one of {ALLOCATORS}")
    if n <= 8:
        return 8
    # jemalloc 5: 16-byte quantum, then 4 size classes per doubling.
    spacing = max(16, 1 << ((n - 1).bit_length() - 3))
    return -(-n // spacing) * spacing


def geometry_json(geometry: Geometry) -> str:
    """The ``geometry`` field as the route cache stores it (route_cache.record_format)."""
    return json.dumps(
        {
            "format": _FORMAT_VERSION,
            "moe_layers": list(geometry.moe_layers),
            "topk": geometry.topk,
            "num_experts": geometry.num_experts,
            "model_id": geometry.model_id,
        },
        sort_keys=True,
        separators=(",", ":"),
    )


def descriptor_json(geometry: Geometry, tokens: int, logprob_tokens: int = 0) -> str:
    """A one-block record's ``b@0`` descriptor, checksums at their widest (an upper bound
    within a few bytes per MoE layer of route_cache.record_format.block_fields')."""
    rows = tokens - 1
    part = rows * geometry.topk * id_bytes(geometry)
    desc = {
        "row_start": 0,
        "num_rows": rows,
        "token_start": 0,
        "num_tokens": tokens,
        "encoding": "raw",
        "parts": [[part, _CHECKSUM] for _ in geometry.moe_layers],
        "tokens_checksum": _CHECKSUM,
        "turns": [[0, tokens, tokens - logprob_tokens, 0, logprob_tokens]],
    }
    return json.dumps(desc, separators=(",", ":"))


def record_size(
    geometry: Geometry,
    tokens: int,
    logprob_tokens: int = 0,
    allocator: str = "jemalloc",
    overhead: int = RECORD_OVERHEAD,
) -> RecordSize:
    """A single-turn record of ``tokens`` tokens, as Redis holds it."""
    routes = (tokens - 1) * route_bytes_per_token(geometry)
    token_bytes = TOKEN_ID_BYTES * tokens + LOGPROB_BYTES * logprob_tokens
    small = (
        len(geometry_json(geometry)),
        len(descriptor_json(geometry, tokens, logprob_tokens)),
    )
    redis_bytes = overhead + sum(allocated(n, allocator) for n in (routes, token_bytes, *small))
    return RecordSize(routes, token_bytes, sum(small), redis_bytes)


@dataclass(frozen=True)
class Sizing:
    """A run's route bytes and the Redis memory its records in flight take."""

    geometry: Geometry
    run: Run
    record: RecordSize

    @property
    def route_bytes_per_token(self) -> int:
        return route_bytes_per_token(self.geometry)

    @property
    def route_bytes_per_sample(self) -> int:
        return self.record.route_bytes

    @property
    def route_bytes_per_step(self) -> int:
        return self.run.samples_per_step * self.record.route_bytes

    @property
    def redis_bytes_per_step(self) -> int:
        return self.run.samples_per_step * self.record.redis_bytes

    @property
    def records_in_flight(self) -> int:
        return self.run.steps_in_flight * self.run.samples_per_step

    @property
    def redis_bytes(self) -> int:
        """The Redis memory the run's records in flight take, Redis's own included."""
        return REDIS_BASE_BYTES + self.records_in_flight * self.record.redis_bytes

    def maxmemory_needed(self, masters: int = 1, budget: float = MEMORY_BUDGET) -> int:
        """The ``maxmemory`` of each of ``masters`` Redis nodes (a Cluster's records spread
        over its masters by hash slot) for the run, when the route cache refuses writes at
        ``budget`` of it."""
        records = math.ceil(self.records_in_flight / masters) * self.record.redis_bytes
        return math.ceil((REDIS_BASE_BYTES + records) / budget)

    def steps_held(self, maxmemory: int, masters: int = 1, budget: float = MEMORY_BUDGET) -> int:
        """Whole steps of records that ``masters`` nodes of ``maxmemory`` bytes each hold
        before the route cache's memory budget refuses writes."""
        usable = max(0, int(budget * maxmemory) - REDIS_BASE_BYTES) * masters
        return usable // self.redis_bytes_per_step


def size_run(
    geometry: Geometry, run: Run, allocator: str = "jemalloc", overhead: int = RECORD_OVERHEAD
) -> Sizing:
    record = record_size(geometry, run.tokens, run.logprob_tokens, allocator, overhead)
    return Sizing(geometry, run, record)


def read_config(path: str | Path) -> tuple[dict[str, Any], str]:
    """A checkpoint's ``config.json`` (``path`` is the file or its folder) and the model id
    the rollout server would store (the folder's name).

    Raises:
        ValueError: No such file, or not JSON.
    """
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(
            f"{path}: no such file (give a checkpoint folder or its config.json)"
        ) from None
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot read it as JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{path}: not a config.json (a JSON object)")
    return config, path.resolve().parent.name


def geometry_of(config: dict[str, Any], model_id: str = "", where: str = "config.json") -> Geometry:
    """The routing geometry of a ``config.json``.

    Raises:
        ValueError: Not an MoE model the project knows (its ``model_type``), or no MoE layer.
    """
    try:
        return geometry_from_config(config, model_id).record
    except (KeyError, TypeError, ValueError) as exc:
        detail = f"lacks {exc}" if isinstance(exc, KeyError) else str(exc)
        raise ValueError(
            f"{where}: not an MoE model whose routes can be sized "
            f"(model_type {config.get('model_type')!r}): {detail}"
        ) from exc


_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 2**10, "m": 10**6, "mb": 2**20, "g": 10**9}
_UNITS["gb"] = 2**30


def parse_memory(text: str) -> int:
    """A memory size as Redis reads ``maxmemory``: ``1gb`` is 2**30 bytes, ``1g`` 10**9."""
    found = re.fullmatch(r"\s*(\d+)\s*([a-z]*)\s*", text.lower())
    if not found or found.group(2) not in _UNITS:
        raise ValueError(f"{text!r} is not a Redis memory size (e.g. 2gb, 512mb, 4000000000)")
    return int(found.group(1)) * _UNITS[found.group(2)]


def human(n: int) -> str:
    """Bytes in binary units (Redis's ``gb`` is a GiB)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def report(
    sizing: Sizing,
    maxmemory: int | None = None,
    masters: int = 1,
    budget: float = MEMORY_BUDGET,
) -> str:
    """What ``routes size`` prints."""
    g, run = sizing.geometry, sizing.run
    needed = sizing.maxmemory_needed(masters, budget)
    setting = "maxmemory per master:" if masters > 1 else "maxmemory to set:"
    lines = [
        f"model {g.model_id or '-'}: {g.num_moe_layers} MoE layers, top-{g.topk} of "
        f"{g.num_experts} experts, {id_bytes(g)} byte(s) per expert id",
        f"route bytes per token:  {sizing.route_bytes_per_token}",
        f"route bytes per sample: {sizing.route_bytes_per_sample} "
        f"({human(sizing.route_bytes_per_sample)}; {run.tokens - 1} rows of {run.tokens} tokens)",
        f"route bytes per step:   {sizing.route_bytes_per_step} "
        f"({human(sizing.route_bytes_per_step)}; {run.samples_per_step} samples)",
        f"Redis bytes per sample: {sizing.record.redis_bytes} (the routes, "
        f"{sizing.record.token_bytes} token bytes, descriptors, Redis's own overhead)",
        f"Redis bytes per step:   {sizing.redis_bytes_per_step} "
        f"({human(sizing.redis_bytes_per_step)})",
        f"records in flight:      {sizing.records_in_flight} ({run.steps_in_flight} steps: "
        f"{run.steps_ahead} ahead + checkpoint interval {run.checkpoint_interval} + 1 training)",
        f"Redis memory needed:    {human(sizing.redis_bytes)} ({sizing.redis_bytes} bytes)",
        f"{setting:<24}{human(needed)} ({needed} bytes"
        + (f", {masters} masters" if masters > 1 else "")
        + f"): routes fill --memory-budget {budget:g} of it; memory limit twice it",
    ]
    if maxmemory is not None:
        held = sizing.steps_held(maxmemory, masters, budget)
        given = f"maxmemory {human(maxmemory)}" + (f" x {masters}:" if masters > 1 else ":")
        lines.append(
            f"{given:<24}holds {held} step(s) of the {run.steps_in_flight} in flight"
            + (", fewer than two" if held < 2 else "")
            + ("; enough" if maxmemory >= needed else f"; too small, set {human(needed)}")
        )
    return "\n".join(lines)
