"""The checks a trainer applies to a fetched record before replaying it, written once for the
trainer (``trainer.layout.align``) and the verl glue.

- ``check_geometry``: the record was routed by this model's shape (MoE layers, top-k, expert
  count) and, when the trainer names one, by this model id.
- ``check_tokens``: the record's tokens are the batch's sample, exactly (the trainer's rule).
- ``first_turn_difference``: where the batch's tokens first differ from the record's, refused
  inside the record's first turn (verl's rule: its token builders may drop a stop token where a
  tool's answer follows a generation, so later turns may differ; the rows from there route
  natively).
- ``MissingRecord``, ``absent_samples`` and ``decide_missing``: what a step does with a sample
  without a record (the one place that decides it).
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from routereplay.domain.record import Geometry, Record
from routereplay.errors import InvalidArgument, NotFound


class MissingRecord(enum.StrEnum):
    """What a step does with a sample that has no record."""

    ERROR = "error"  # fail the step, naming the samples
    NATIVE = "native"  # route that sample naturally, with a warning and a counter


def absent_samples(sample_ids: Sequence[str], records: Sequence[Record | None]) -> list[str]:
    """The ids of ``sample_ids`` whose record (same position in ``records``) is None."""
    return [s for s, r in zip(sample_ids, records, strict=True) if r is None]


@dataclass(frozen=True)
class Absent:
    """What becomes of a batch's samples without a record (``decide_missing``).

    Attributes:
        native: trained with native routing (their tokens are known without the record).
        dropped: trained nothing (no tokens without the record): left out of the batch.
        dead_letter: ``dropped`` are published samples, committed then lost: the consumer
            that read them settles them to the feed's dead-letter stream with
            ``MISSING_RECORD_REASON``.
    """

    native: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    dead_letter: bool = False


# The dead-letter reason of a published sample whose record is gone.
MISSING_RECORD_REASON = "record missing: announced on the ready feed, gone when read"


def decide_missing(
    sample_ids: Sequence[str],
    records: Sequence[Record | None],
    policy: MissingRecord,
    *,
    tokens_known: bool,
    published: bool = False,
) -> Absent:
    """Decide for a batch's samples whose record is None.

    A published sample (read from the ready feed, so its record was committed) whose tokens
    live only in that record cannot train, whatever ``policy`` says: failing its batch would
    fail it again on every restart (the entry stays pending). It is dropped and dead-lettered,
    and the batch trains the rest. Otherwise ``policy`` decides: ``error`` refuses the batch,
    ``native`` routes the sample natively where its tokens are known and drops it where not.

    Raises:
        NotFound: a record is missing under ``error`` (not a published sample).
    """
    absent = absent_samples(sample_ids, records)
    if not absent:
        return Absent()
    if published and not tokens_known:
        return Absent(dropped=absent, dead_letter=True)
    if policy == MissingRecord.ERROR:
        raise NotFound(
            f"no record in the route cache for {len(absent)} of {len(records)} samples: "
            f"{absent[:8]} (expired, never written, or another route cache; the "
            "missing-record policy 'native' trains them with native routing)"
        )
    return Absent(native=absent) if tokens_known else Absent(dropped=absent)


def check_geometry(record: Geometry, model: Geometry, sample_id: str, model_id: str | None) -> None:
    """Refuse a record routed by another model shape, or (when ``model_id`` is given) by
    another model id, naming both sides.

    Raises:
        InvalidArgument: The shapes or the model ids differ.
    """
    ours = (model.moe_layers, model.topk, model.num_experts)
    theirs = (record.moe_layers, record.topk, record.num_experts)
    if ours != theirs:
        raise InvalidArgument(
            f"record {sample_id!r}: geometry (moe_layers={list(record.moe_layers)}, "
            f"topk={record.topk}, num_experts={record.num_experts}) does not match the model's "
            f"(moe_layers={list(model.moe_layers)}, topk={model.topk}, "
            f"num_experts={model.num_experts})"
        )
    if model_id is not None and record.model_id != model_id:
        raise InvalidArgument(
            f"record {sample_id!r} was routed by model {record.model_id!r}; "
            f"the trainer runs {model_id!r}"
        )


def first_difference(record: Record, tokens: np.ndarray) -> int | None:
    """The first position, within both, where ``tokens`` differ from the record's; None when
    one is a prefix of the other."""
    n = min(record.token_ids.size, tokens.size)
    diff = np.flatnonzero(record.token_ids[:n] != tokens[:n])
    return int(diff[0]) if diff.size else None


def check_tokens(record: Record, tokens: np.ndarray) -> None:
    """Refuse a record whose token ids differ from the batch's sample, naming both sides.

    Raises:
        InvalidArgument: They differ (in a token or in length).
    """
    if record.token_ids.shape == tokens.shape and np.array_equal(record.token_ids, tokens):
        return
    where = first_difference(record, tokens)
    where = min(record.token_ids.size, tokens.size) if where is None else where
    raise InvalidArgument(
        f"record {record.sample_id!r}: token ids differ from the batch's at position {where} "
        f"(record has {record.token_ids.size} tokens, "
        f"{record.token_ids[where : where + 4].tolist()}...; batch has {tokens.size}, "
        f"{tokens[where : where + 4].tolist()}...)"
    )


def first_turn_difference(record: Record, tokens: np.ndarray, sample_id: str) -> int | None:
    """Where ``tokens`` first differ from the record's (None: nowhere in common), refused
    inside the record's first turn (before its last token): the routes of another sample or
    of another tokenization.

    Raises:
        InvalidArgument: The difference is inside the first turn.
    """
    at = first_difference(record, tokens)
    first_turn_end = record.turns[0].token_end if record.turns else record.num_tokens
    if at is not None and at < first_turn_end - 1:
        raise InvalidArgument(
            f"sample {sample_id!r}: the route record's tokens differ from the batch's at "
            f"position {at}, inside its first turn (tokens 0-{first_turn_end - 1}; "
            f"record {record.num_tokens} tokens, batch {tokens.size}): routes of another sample "
            "or of another tokenization"
        )
    return at
