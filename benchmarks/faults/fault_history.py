"""The fault run's history and its checker (``bench_faults.py`` drives the run).

Every client operation is logged with its outcome: writers' writes and appends, consumers'
deliveries, trained samples and acknowledgements, and the faults themselves. A history is a
list of dicts, kept in memory and written one JSON object per line. The checker reads it,
and the records as the route cache holds them at the end, and says what broke.

What the writers send is a pure function of (seed, sample id, turn), so the checker rebuilds
the exact bytes of every turn instead of keeping them.

Ops (``op``), with their fields besides ``t`` (seconds since the run's start), ``proc``:
    config: ``seed``, ``turns`` and the run's other settings (what the checker needs)
    write, append: ``sample``, ``turn``, ``final``, ``ok``, ``status`` (on failure), ``ms``,
        ``shard`` (of the sample's record), ``via`` (``any``, or ``cache0``: that replica only)
    read: ``shard``, ``via``, ``ok``, ``ms``, ``got`` ([sample, turns held, digest, turns
        acknowledged before the read began] per sample read)
    fault: ``name``, ``component`` (``shardN``, ``cache0``, ``c0``, ``all``), ``t`` (its
        injection), ``end`` (when it was healed), ``detail`` (``error``: it did not happen)
    deliver: ``samples`` (handed to a consumer); train: ``sample``, ``digest`` (of the record
        the consumer trained on), ``turns``
    ack: ``samples``, ``ok``; dropped_ack: ``samples`` (the deliberate failure)
    duplicate: ``samples`` (dropped as repeats; ``taken``: claimed by another consumer)
    final_read: ``sample``, ``turns``, ``digest`` (None: no record), ``freed`` (its expiry
        brought down to the route cache's grace: every commit group acknowledged it), read
        after the run
    feed_state: ``groups`` (per consumer group: ``name``, ``pending``, ``lag``, ...), after it

``python -m benchmarks.faults.fault_check HISTORY`` prints the verdict from the file alone.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
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

    def log_step(self, step: int, fetched) -> dict:
        """A trainer's ``step``: its number, the samples it trained and each record's digest
        (``fetched``: a ``trainer.data.source.FetchedBatch``)."""
        return self.log(
            "step",
            step=step,
            samples=[s.sample_id for s in fetched.samples],
            digests=[digest(r) for r in fetched.records],
            turns=[len(r.turns) for r in fetched.records],
        )

    @contextmanager
    def acks_of(self, plans) -> Iterator[None]:
        """Log ``ack`` with the samples of the batches a trainer's ``plans``
        (``trainer.data.source.FeedPlans``) acknowledged within: those that left its
        ``handed_out``."""
        held = {step: list(groups) for step, groups in plans.handed_out.items()}
        yield
        samples = [
            s
            for step in held
            if step not in plans.handed_out
            for g in held[step]
            for s in g.sample_ids
        ]
        if samples:
            self.log("ack", samples=samples, ok=True)

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


# --- the end state, saved in the history --------------------------------------------------------


def final_entries(
    records: dict[str, Record | None], freed: dict[str, bool] | None = None
) -> list[dict]:
    """The final read as history entries: turns held and digest per sample (None: no record),
    and (``freed``) whether the route cache had freed it (its expiry down to the grace)."""
    return [
        {
            "t": 0.0,
            "proc": "final",
            "op": "final_read",
            "sample": s,
            "turns": len(r.turns) if r is not None else 0,
            "digest": digest(r) if r is not None else None,
            **({"freed": freed.get(s, False)} if freed is not None else {}),
        }
        for s, r in sorted(records.items())
    ]


def _final_read(history: list[dict]) -> dict[str, tuple[int, str | None]]:
    found = {e["sample"]: (e["turns"], e["digest"]) for e in history if e["op"] == "final_read"}
    if not found and any(e["op"] in WRITES for e in history):
        raise ValueError("the history holds no final read (op final_read): nothing to check")
    return found


# --- what each fault met ----------------------------------------------------------------------

WRITES = ("write", "append")
STORE_OPS = ("write", "append", "read")


def on_component(component: str, e: dict) -> bool:
    """Whether operation ``e`` (a write, append or read) ran on ``component``: ``shardN`` (its
    sample's record lies in shard N's slots), ``cache0`` (sent to route cache 0 only) or
    ``all``."""
    if e["op"] not in STORE_OPS:
        return False
    if component == "all":
        return True
    if component.startswith("shard"):
        return e.get("shard") == int(component[5:])
    return e.get("via") == component


def is_consumer(component: str) -> bool:
    """``c0``, ``c1``: a consumer process; ``trainer``: the trainer's feed path."""
    return (component[:1] == "c" and component[1:].isdigit()) or component == TRAINER


TRAINER = "trainer"  # the trainer process's ``proc`` and component (``fault_trainer.py``)


def trainer_steps(history: list[dict]) -> dict | None:
    """The trainer's steps (``fault_trainer.py``), split into those the final weights descend
    from (committed) and those trained by a process that was killed before a checkpoint
    covered them (discarded); None when the history has no trainer.

    Each process logs ``resume`` (the steps its checkpoint covers) first, then ``step``s; the
    last one ``finish``. Walking back from the end: the last process's steps up to its finish
    are committed, those before its resume point come from the process before, and so on."""
    lives: list[dict] = []
    for e in history:
        if e["proc"] != TRAINER:
            continue
        if e["op"] == "resume":
            lives.append(
                {"from": e["steps_done"], "steps": [], "to": None, "saved": e["steps_done"]}
            )
        elif lives and e["op"] == "step":
            lives[-1]["steps"].append(e)
        elif lives and e["op"] == "checkpoint":
            lives[-1]["saved"] = e["steps_done"]
        elif lives and e["op"] == "finish":
            lives[-1]["to"] = e["steps_done"]
    if not lives:
        return None
    committed: list[dict] = []
    discarded: list[dict] = []
    bound = lives[-1]["to"] if lives[-1]["to"] is not None else lives[-1]["saved"]
    for life in reversed(lives):
        for e in life["steps"]:
            (committed if life["from"] <= e["step"] < bound else discarded).append(e)
        bound = min(bound, life["from"])
    committed.sort(key=lambda e: e["step"])
    return {
        "committed": committed,
        "discarded": discarded,
        "processes": len(lives),
        "finished": lives[-1]["to"] is not None,
    }


def floor(history: list[dict], fault: dict) -> dict:
    """The traffic fault ``fault`` met on its component: operations started between its
    injection (``t``) and its heal (``end``), in flight at the injection, and of those two,
    acknowledged. A stopped consumer (component ``c0``): the samples it held (delivered, not
    settled) when it was stopped, the feed's deliveries while it was stopped, and how many of
    the held samples were settled after they were handed out (by any consumer of its group;
    the trainer, killed and restarted: its own group)."""
    at, end, component = fault["t"], fault["end"], fault.get("component", "all")
    if is_consumer(component):
        held: dict[str, float] = {}
        for e in history:
            if e["t"] >= at or e["proc"] != component:
                continue
            if e["op"] == "resume":  # a new process: what the old one held is back on the feed
                held.clear()
                continue
            if e["op"] == "deliver":
                held.update(dict.fromkeys(e["samples"], e["t"]))
            elif e["op"] in ("ack", "duplicate", "dropped_ack") and e.get("ok", True):
                for s in e["samples"]:
                    held.pop(s, None)

        # The trainer has a consumer group of its own: only its acknowledgements count.
        def mine(e: dict) -> bool:
            return (e["proc"] == TRAINER) == (component == TRAINER)

        # Settled after they were handed out (a slow consumer's batch may have been claimed
        # and settled by the other one before the stop).
        since = min(held.values(), default=at)
        settled = {
            s
            for e in history
            if e["op"] == "ack" and e.get("ok", True) and e["t"] >= since and mine(e)
            for s in e["samples"]
        }
        started = [e for e in history if e["op"] == "deliver" and at <= e["t"] <= end and mine(e)]
        return {
            "fault": fault["name"],
            "component": component,
            "started": len(started),
            "in_flight": len(held),
            "acknowledged": len(set(held) & settled),
        }
    ops = [e for e in history if on_component(component, e)]
    started = [e for e in ops if at <= e["t"] <= end]
    in_flight = [e for e in ops if e["t"] < at < e["t"] + e["ms"] / 1000]
    return {
        "fault": fault["name"],
        "component": component,
        "started": len(started),
        "in_flight": len(in_flight),
        "acknowledged": sum(e["ok"] for e in started + in_flight),
    }


def write_gaps(history: list[dict], window: tuple[float, float] | None = None) -> dict:
    """Per shard, the longest time with no write or append completed on it (within
    ``window``, default the writers' whole span): ``{shard: (gap_s, from_s)}``."""
    writes = [e for e in history if e["op"] in WRITES and "shard" in e]
    if not writes:
        return {}
    lo, hi = window or (min(e["t"] for e in writes), max(e["t"] for e in writes))
    out = {}
    for shard in sorted({e["shard"] for e in writes}):
        done = sorted(
            e["t"] + e["ms"] / 1000
            for e in writes
            if e["shard"] == shard and e["ok"] and lo <= e["t"] + e["ms"] / 1000 <= hi
        )
        marks = [lo, *done, hi]
        gap, since = max((b - a, a) for a, b in zip(marks, marks[1:], strict=False))
        out[shard] = (round(gap, 2), round(since, 2))
    return out


# --- the checker ------------------------------------------------------------------------------


@dataclass
class Verdict:
    """What the checker found. ``ok`` when every list is empty."""

    lost: list[str] = field(default_factory=list)  # acknowledged turns not stored as sent
    half_written: list[str] = field(default_factory=list)  # stored, but not whole turns
    trained_twice: list[str] = field(default_factory=list)
    never_trained: list[str] = field(default_factory=list)  # published, not trained
    trained_wrong: list[str] = field(default_factory=list)  # trained on other bytes
    trained_unacked: list[str] = field(default_factory=list)  # trained, never acknowledged
    read_wrong: list[str] = field(default_factory=list)  # a read: other bytes, or stale
    faults_not_injected: list[str] = field(default_factory=list)  # injection/effect failed
    faults_without_traffic: list[str] = field(default_factory=list)  # a zero in its floor
    feed_left_pending: list[str] = field(default_factory=list)  # entries pending at the end
    # The trainer (its committed steps: those the final weights descend from).
    trainer_trained_twice: list[str] = field(default_factory=list)
    trainer_never_trained: list[str] = field(default_factory=list)  # published, in no step
    trainer_trained_wrong: list[str] = field(default_factory=list)
    trainer_unfinished: list[str] = field(default_factory=list)  # no final checkpoint
    # Freed (its expiry brought down to the grace) while a commit group had not committed it.
    freed_before_commit: list[str] = field(default_factory=list)
    floors: list[dict] = field(default_factory=list)
    counts: dict = field(default_factory=dict)

    CHECKS = (
        "lost",
        "half_written",
        "trained_twice",
        "never_trained",
        "trained_wrong",
        "trained_unacked",
        "read_wrong",
        "faults_not_injected",
        "faults_without_traffic",
        "feed_left_pending",
        "trainer_trained_twice",
        "trainer_never_trained",
        "trainer_trained_wrong",
        "trainer_unfinished",
        "freed_before_commit",
    )

    @property
    def ok(self) -> bool:
        return not any(getattr(self, name) for name in self.CHECKS)

    def lines(self) -> list[str]:
        out = [f"verdict: {'PASS' if self.ok else 'FAIL'}"]
        for name in self.CHECKS:
            found = getattr(self, name)
            out.append(f"  {name}: {len(found)}" + (f"  e.g. {found[:3]}" if found else ""))
        out += [f"  {k}: {v}" for k, v in self.counts.items()]
        if self.floors:
            out.append(
                f"  {'traffic floor per fault':24} {'component':>9} {'started':>7} "
                f"{'in flight':>9} {'acked':>5}"
            )
            for f in self.floors:
                out.append(
                    f"  {f['fault']:24} {f['component']:>9} {f['started']:7} "
                    f"{f['in_flight']:9} {f['acknowledged']:5}"
                )
        return out


def check(
    history: list[dict],
    seed: int,
    turns_per_sample: int,
    stored: Callable[[list[str]], dict[str, Record | None]] | None = None,
) -> Verdict:
    """Check ``history`` against its final read (``final_read`` entries; or the records
    ``stored(sample_ids)`` returns, None: none).

    - every acknowledged turn is stored with its exact bytes, in order (not lost);
    - a record holds whole turns only, each as sent, never one twice, never a turn past the
      last one attempted: a refused or unacknowledged turn is there whole or not at all;
    - every read returned the bytes sent, and at least the turns acknowledged before it began;
    - every published sample (its final turn acknowledged) was trained by exactly one
      consumer, on the whole record's exact bytes, and acknowledged on the feed; nothing is
      left pending on the feed at the end (``feed_state``);
    - every fault was injected and had its effect (no ``error`` in its detail), and met
      traffic on its component: a nonzero floor (``floor``).
    """
    acked: dict[str, int] = defaultdict(int)  # sample -> acknowledged turns (a prefix)
    attempted: dict[str, int] = defaultdict(int)  # sample -> turns attempted
    for e in history:
        if e["op"] in WRITES:
            attempted[e["sample"]] = max(attempted[e["sample"]], e["turn"] + 1)
            if e["ok"]:
                acked[e["sample"]] = max(acked[e["sample"]], e["turn"] + 1)
    verdict = Verdict()
    if stored is not None:
        final = {
            e["sample"]: (e["turns"], e["digest"]) for e in final_entries(stored(sorted(attempted)))
        }
    else:
        final = _final_read(history)
    for sample_id, tried in sorted(attempted.items()):
        held, found = final.get(sample_id, (0, None))
        if held > tried or (found is not None and found != _sent(seed, sample_id, held)):
            verdict.half_written.append(sample_id)
        elif held < acked[sample_id]:
            verdict.lost.append(sample_id)

    for e in history:
        if e["op"] != "read" or not e["ok"]:
            continue
        for sample_id, held, found, acked_before in e["got"]:
            if held < acked_before or found != _sent(seed, sample_id, held):
                verdict.read_wrong.append(sample_id)
    verdict.read_wrong = sorted(set(verdict.read_wrong))

    trained: dict[str, list[dict]] = defaultdict(list)
    ack_samples: Counter[str] = Counter()
    for e in history:
        if e["op"] == "train":
            trained[e["sample"]].append(e)
        elif e["op"] == "ack" and e.get("ok", True) and e["proc"] != TRAINER:
            ack_samples.update(e["samples"])
    published = {s for s, n in acked.items() if n == turns_per_sample}
    for sample_id, events in sorted(trained.items()):
        if len(events) > 1:
            verdict.trained_twice.append(sample_id)
        if any(e["digest"] != _sent(seed, sample_id, turns_per_sample) for e in events):
            verdict.trained_wrong.append(sample_id)
        if not ack_samples[sample_id]:
            verdict.trained_unacked.append(sample_id)
    verdict.never_trained = sorted(published - set(trained))

    steps = trainer_steps(history)
    if steps is not None:
        in_steps: Counter[str] = Counter()
        for e in steps["committed"]:
            in_steps.update(e["samples"])
            for sample_id, found in zip(e["samples"], e["digests"], strict=True):
                if found != _sent(seed, sample_id, turns_per_sample):
                    verdict.trainer_trained_wrong.append(sample_id)
        verdict.trainer_trained_twice = sorted(s for s, n in in_steps.items() if n > 1)
        verdict.trainer_never_trained = sorted(published - set(in_steps))
        if not steps["finished"]:
            verdict.trainer_unfinished.append("the last trainer process did not finish")

    # The lifecycle: a record freed is one every commit group (the consumers' and the
    # trainer's) acknowledged after committing its training.
    trainer_acked = {
        s for e in history if e["op"] == "ack" and e.get("ok") and e["proc"] == TRAINER
        for s in e["samples"]
    }  # fmt: skip
    committed_by_all = {s for s in ack_samples if s in trainer_acked or steps is None}
    verdict.freed_before_commit = sorted(
        e["sample"]
        for e in history
        if e["op"] == "final_read" and e.get("freed") and e["sample"] not in committed_by_all
    )

    faults = [e for e in history if e["op"] == "fault"]
    for f in faults:
        if "error" in f["detail"]:
            verdict.faults_not_injected.append(f"{f['name']}: {f['detail']['error']}")
        verdict.floors.append(floor(history, f))
    verdict.faults_without_traffic = [
        f"{x['fault']} ({x['component']})"
        for x in verdict.floors
        if not (x["started"] and x["in_flight"] and x["acknowledged"])
    ]
    for e in history:
        if e["op"] == "feed_state":
            verdict.feed_left_pending += [
                f"{g['name']}: {g['pending']} pending" for g in e["groups"] if g["pending"]
            ]
    ops = Counter(e["op"] for e in history)
    verdict.counts = {
        "samples attempted": len(attempted),
        "samples published (final turn acknowledged)": len(published),
        "turns acknowledged": sum(acked.values()),
        "samples trained": len(trained),
        "reads checked": sum(len(e["got"]) for e in history if e["op"] == "read" and e["ok"]),
        "repeats dropped by consumers": sum(
            len(e["samples"]) for e in history if e["op"] == "duplicate"
        ),
        "faults": ops["fault"],
        "records freed (every group committed them)": sum(
            1 for e in history if e["op"] == "final_read" and e.get("freed")
        ),
        # Named losses: published samples whose record was gone when trained (each is also
        # lost, never trained: a run that has any fails).
        "samples dead-lettered (record gone)": len(
            {s for e in history if e["op"] == "dead_letter" for s in e["samples"]}
        ),
    }
    if steps is not None:
        verdict.counts["trainer steps trained / committed / discarded"] = (
            f"{len(steps['committed']) + len(steps['discarded'])} / {len(steps['committed'])}"
            f" / {len(steps['discarded'])}"
        )
        verdict.counts["trainer samples in discarded steps"] = sum(
            len(e["samples"]) for e in steps["discarded"]
        )
        verdict.counts["trainer processes"] = steps["processes"]
    return verdict


def flagged(verdict: Verdict) -> list[str]:
    """The samples the checker found wrong, in order (what ``trail`` tells the story of)."""
    found = []
    for name in Verdict.CHECKS:
        if not name.startswith(("faults_", "feed_", "trainer_unfinished")):
            found += [s for s in getattr(verdict, name) if s not in found]
    return found


def trail(history: list[dict], sample_ids: Iterable[str], log_dir: Path | None = None):
    """Every event naming one of ``sample_ids`` (reads aside), the faults, and the lines of
    the services' logs in ``log_dir`` (``*.log``) naming it, in time order: a failed run's
    report tells what became of each wrong sample without its history file (a CI log is all
    there is)."""
    sample_ids = list(sample_ids)
    logs = {}
    if sample_ids and log_dir is not None:  # a run that passed reads no log
        logs = {p.name: p.read_text(errors="replace") for p in log_dir.glob("*.log")}
    out = []
    for sample_id in sample_ids:
        out.append(f"trail of {sample_id}:")
        for e in history:
            if e["op"] == "fault":
                out.append(
                    f"  {e['began']:8.3f}-{e['end']:.3f} fault {e['name']} on {e['component']}"
                )
            elif e["op"] != "read" and (
                e.get("sample") == sample_id or sample_id in e.get("samples", ())
            ):
                rest = {k: v for k, v in e.items() if k not in ("t", "proc", "op", "sample")}
                if "entries" in rest and len(rest["entries"]) == len(e["samples"]):
                    rest["entries"] = [
                        x for x, s in zip(e["entries"], e["samples"], strict=True) if s == sample_id
                    ]
                rest.pop("samples", None)
                out.append(f"  {e['t']:8.3f} {e['proc']:>7} {e['op']} {rest}")
        for name, text in sorted(logs.items()):
            out += [f"  {name}: {line}" for line in text.splitlines() if sample_id in line]
    return out


_SENT: dict[tuple[int, str, int], str] = {}


def _sent(seed: int, sample_id: str, turns: int) -> str:
    """The digest of the record holding turns ``[0, turns)`` as sent (cached)."""
    key = (seed, sample_id, turns)
    if key not in _SENT:
        _SENT[key] = digest(expected(seed, sample_id, turns))
    return _SENT[key]


def check_file(path: Path) -> tuple[Verdict, dict]:
    """The verdict from a history file alone (its ``config`` entry names the seed and the
    turns per sample). Returns (verdict, that config)."""
    history = load_history([path])
    config = next((e for e in history if e["op"] == "config"), None)
    if config is None:
        raise ValueError(f"{path}: no config entry (op config)")
    return check(history, config["seed"], config["turns"]), config
