"""The fault run's history and its checker (``bench_faults.py`` drives the run).

Every client operation is logged with its outcome: writers' writes and appends, consumers'
deliveries, trained samples and acknowledgements, and the faults themselves. A history is a
list of dicts, kept in memory and written one JSON object per line. The checker reads it,
and the records as the route cache holds them at the end, and says what broke.

What the writers send is a pure function of (seed, sample id, turn), so the checker rebuilds
the exact bytes of every turn instead of keeping them.

Ops (``op``), with their fields besides ``t`` (seconds since the run's start), ``proc``:
    write, append: ``sample``, ``turn``, ``final``, ``ok``, ``status`` (on failure), ``ms``
    fault: ``name``, ``end`` (when it was healed), ``detail``
    train: ``sample``, ``digest`` (of the record the consumer trained on), ``turns``
    ack: ``samples``, ``ok``; dropped_ack: ``samples`` (the deliberate failure)
    duplicate: ``samples`` (dropped as repeats; ``taken``: claimed by another consumer)
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from routereplay.domain.record import Geometry, Record, Turn, TurnAppend

# Small records: the run measures what faults do to the service, not bandwidth.
GEOMETRY = Geometry((1, 2, 3, 4), topk=2, num_experts=8, model_id="faultrun-moe")
FIRST_TOKENS = 32  # turn 0: 16 prompt tokens, 16 generated
LATER_TOKENS = 24  # each later turn: 8 prompt tokens (tool output, user), 16 generated
GENERATED = 16


class History:
    """A thread-safe operation log, in memory and appended to ``path`` (JSONL) as it grows.

    Args:
        path: the JSONL file (None: memory only).
        proc: the default ``proc`` of entries.
        start: the run's time zero (``time.time()`` seconds; shared by every process).
    """

    def __init__(self, path: Path | None, proc: str, start: float):
        self.path, self.proc, self.start = path, proc, start
        self.entries: list[dict] = []
        self._lock = threading.Lock()
        self._file = open(path, "a", buffering=1) if path else None  # noqa: SIM115

    def now(self) -> float:
        return time.time() - self.start

    def log(self, op: str, t: float | None = None, **fields) -> dict:
        """Log ``op`` at ``t`` (default: now) with ``fields``."""
        entry = {
            "t": round(self.now(), 4) if t is None else t,
            "proc": self.proc,
            "op": op,
            **fields,
        }
        with self._lock:
            self.entries.append(entry)
            if self._file:
                self._file.write(json.dumps(entry) + "\n")
        return entry

    def close(self) -> None:
        if self._file:
            self._file.close()


def load_history(paths: Iterable[Path]) -> list[dict]:
    """Every entry of these JSONL files, in time order."""
    entries = []
    for path in paths:
        if Path(path).exists():
            entries += [json.loads(line) for line in Path(path).read_text().splitlines() if line]
    return sorted(entries, key=lambda e: e["t"])


# --- what was sent ----------------------------------------------------------------------------


def _rng(seed: int, sample_id: str, turn: int) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(sample_id.encode()), turn])


def _turn_tokens(seed: int, sample_id: str, turn: int) -> tuple[np.ndarray, np.ndarray, Turn]:
    """(token ids int32 [N], routes [N - (turn == 0), L, k], the turn) of ``turn``."""
    rng = _rng(seed, sample_id, turn)
    count = FIRST_TOKENS if turn == 0 else LATER_TOKENS
    start = 0 if turn == 0 else FIRST_TOKENS + (turn - 1) * LATER_TOKENS
    tokens = rng.integers(0, 512, count, dtype=np.int32)
    rows = count - 1 if turn == 0 else count
    # Distinct expert ids per token and layer: a random permutation's first k.
    order = np.argsort(rng.random((rows, GEOMETRY.num_moe_layers, GEOMETRY.num_experts)), -1)
    routes = order[..., : GEOMETRY.topk].astype(GEOMETRY.dtype)
    logprobs = -rng.exponential(size=GENERATED).astype(np.float32)
    end = start + count
    return tokens, routes, Turn(start, end, end - GENERATED, turn, logprobs)


def first_turn(seed: int, sample_id: str) -> Record:
    tokens, routes, turn = _turn_tokens(seed, sample_id, 0)
    return Record(sample_id, GEOMETRY, tokens, routes, [turn])


def later_turn(seed: int, sample_id: str, turn: int) -> TurnAppend:
    tokens, routes, t = _turn_tokens(seed, sample_id, turn)
    return TurnAppend(sample_id, GEOMETRY, t.token_start - 1, tokens, routes, [t])


def expected(seed: int, sample_id: str, turns: int) -> Record:
    """The record holding turns ``[0, turns)`` exactly as sent."""
    parts = [_turn_tokens(seed, sample_id, k) for k in range(turns)]
    return Record(
        sample_id,
        GEOMETRY,
        np.concatenate([p[0] for p in parts]),
        np.concatenate([p[1] for p in parts]),
        [p[2] for p in parts],
    )


def digest(record: Record) -> str:
    """What a consumer trained on, and what the checker expects it to be."""
    h = hashlib.sha256(np.ascontiguousarray(record.token_ids, "<i4").tobytes())
    h.update(np.ascontiguousarray(record.routes).tobytes())
    for turn in record.turns:
        h.update(
            np.asarray(
                [turn.token_start, turn.token_end, turn.generated_start, turn.policy_version], "<i8"
            ).tobytes()
        )
        h.update(np.asarray(turn.logprobs, "<f4").tobytes())
    return h.hexdigest()[:16]


# --- the checker ------------------------------------------------------------------------------


@dataclass
class Verdict:
    """What the checker found. ``ok`` when every list is empty and nothing is counted."""

    lost: list[str] = field(default_factory=list)  # acknowledged turns not stored as sent
    half_written: list[str] = field(default_factory=list)  # stored, but not whole turns
    trained_twice: list[str] = field(default_factory=list)
    never_trained: list[str] = field(default_factory=list)  # published, not trained
    trained_wrong: list[str] = field(default_factory=list)  # trained on other bytes
    trained_unacked: list[str] = field(default_factory=list)  # trained, never acknowledged
    counts: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (
            self.lost
            or self.half_written
            or self.trained_twice
            or self.never_trained
            or self.trained_wrong
            or self.trained_unacked
        )

    def lines(self) -> list[str]:
        out = [f"verdict: {'PASS' if self.ok else 'FAIL'}"]
        for name in (
            "lost",
            "half_written",
            "trained_twice",
            "never_trained",
            "trained_wrong",
            "trained_unacked",
        ):
            found = getattr(self, name)
            out.append(f"  {name}: {len(found)}" + (f"  e.g. {found[:3]}" if found else ""))
        out += [f"  {k}: {v}" for k, v in self.counts.items()]
        return out


def check(
    history: list[dict],
    seed: int,
    stored: Callable[[list[str]], dict[str, Record | None]],
    turns_per_sample: int,
) -> Verdict:
    """Check ``history`` against the records ``stored(sample_ids)`` returns (None: none).

    - every acknowledged turn is stored with its exact bytes, in order (not lost);
    - a record holds whole turns only, each as sent, never one twice, never a turn past the
      last one attempted: a refused or unacknowledged turn is there whole or not at all;
    - every published sample (its final turn acknowledged) was trained by exactly one
      consumer, on the whole record's exact bytes, and acknowledged on the feed.
    """
    acked: dict[str, int] = defaultdict(int)  # sample -> acknowledged turns (a prefix)
    attempted: dict[str, int] = defaultdict(int)  # sample -> turns attempted
    for e in history:
        if e["op"] in ("write", "append"):
            attempted[e["sample"]] = max(attempted[e["sample"]], e["turn"] + 1)
            if e["ok"]:
                acked[e["sample"]] = max(acked[e["sample"]], e["turn"] + 1)
    verdict = Verdict()
    records = stored(sorted(attempted))
    for sample_id, tried in sorted(attempted.items()):
        record = records.get(sample_id)
        held = len(record.turns) if record is not None else 0
        if held > tried or (
            record is not None and digest(record) != digest(expected(seed, sample_id, held))
        ):
            verdict.half_written.append(sample_id)
        elif held < acked[sample_id]:
            verdict.lost.append(sample_id)

    trained: dict[str, list[dict]] = defaultdict(list)
    ack_samples: Counter[str] = Counter()
    for e in history:
        if e["op"] == "train":
            trained[e["sample"]].append(e)
        elif e["op"] == "ack" and e.get("ok", True):
            ack_samples.update(e["samples"])
    published = {s for s, n in acked.items() if n == turns_per_sample}
    whole = {s: digest(expected(seed, s, turns_per_sample)) for s in set(trained) | published}
    for sample_id, events in sorted(trained.items()):
        if len(events) > 1:
            verdict.trained_twice.append(sample_id)
        if any(e["digest"] != whole[sample_id] for e in events):
            verdict.trained_wrong.append(sample_id)
        if not ack_samples[sample_id]:
            verdict.trained_unacked.append(sample_id)
    verdict.never_trained = sorted(published - set(trained))
    ops = Counter(e["op"] for e in history)
    verdict.counts = {
        "samples attempted": len(attempted),
        "samples published (final turn acknowledged)": len(published),
        "turns acknowledged": sum(acked.values()),
        "samples trained": len(trained),
        "repeats dropped by consumers": sum(
            len(e["samples"]) for e in history if e["op"] == "duplicate"
        ),
        "faults": ops["fault"],
    }
    return verdict
