"""The rollout service's domain types: what a caller asks for and what it gets back.

No protobuf here: ``rollout_server.convert`` translates at the gRPC edge.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rollout_server.engine import SamplingOptions, TokenDelta
from routereplay.record import Geometry, Turn


@dataclass(frozen=True)
class SampleRequest:
    """One sample to generate.

    Attributes:
        sample_id: The record's key; empty: the server generates one.
        group_id: Samples of one GRPO group share it (may be empty).
        prompt: This turn's prompt: text, or token ids.
        options: Sampling settings.
        return_routes: Put the turn's routes into the final event too.
        announce: Announce the record on the route cache's ready feed once this turn is
            stored (False for a first turn with more to come; True for a last later turn).
    """

    sample_id: str
    group_id: str
    prompt: str | list[int]
    options: SamplingOptions
    return_routes: bool = False
    announce: bool = True


@dataclass(frozen=True)
class SampleDelta:
    """Tokens of one sample generated since its previous delta."""

    sample_id: str
    delta: TokenDelta


@dataclass(frozen=True)
class SampleDone:
    """The end of one sample's turn.

    Attributes:
        sample_id, group_id: The record's key and group.
        finish_reason: ``"stop"`` or ``"length"``.
        prompt_tokens, generated_tokens: Of this turn.
        num_tokens: Tokens of the whole record after this turn.
        stored: The route cache acknowledged the record or append.
        store_error: Why not stored (empty when stored).
        turn: This turn, with the policy version that generated it.
        geometry: The record's geometry.
        routes: With ``return_routes``: this turn's rows ``[rows, num_moe_layers, topk]``
            (uint8, or uint16 above 256 experts), starting at record row ``row_start``.
        row_start: Record row of ``routes[0]``.
        cached_tokens: Prompt tokens served from the engine's prefix cache.
    """

    sample_id: str
    group_id: str
    finish_reason: str
    prompt_tokens: int
    generated_tokens: int
    num_tokens: int
    stored: bool
    store_error: str
    turn: Turn
    geometry: Geometry
    routes: np.ndarray | None = None
    row_start: int = 0
    cached_tokens: int = 0


@dataclass(frozen=True)
class SampleFailed:
    """A sample of a batch that failed (a single Generate raises instead).

    Attributes:
        code: The ``grpc.StatusCode`` name of the failure.
        message: Why.
    """

    sample_id: str
    code: str
    message: str


SampleEvent = SampleDelta | SampleDone | SampleFailed
