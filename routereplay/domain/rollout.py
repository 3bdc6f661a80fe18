"""The Rollout service's domain types: what a caller asks for and what it gets back.

No protobuf here: ``routereplay.rpc.rollout_wire`` translates them for the gRPC contract, both ways.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np

from routereplay.domain.record import Geometry, Turn


@dataclass
class SamplingOptions:
    """Sampling settings of one request.

    Attributes:
        temperature: 0 for greedy decoding.
        top_p: Nucleus sampling mass; 1.0 disables it.
        top_k: Keep the k most likely tokens; 0 (or -1) disables it.
        max_tokens: Most tokens to generate.
        stop: Strings that end generation (the token that completes one is
            kept in ``token_ids``; the text stops before it).
        seed: Per-request sampling seed, or None.
        logprobs: Whether to return the log-probability of each generated token.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    seed: int | None = None
    logprobs: bool = True


@dataclass
class TokenDelta:
    """Tokens generated since the previous delta of the same request.

    Attributes:
        token_ids: New token ids.
        text: Their detokenized text (may lag tokens by a partial character).
        logprobs: One log-probability per new token; empty when not requested.
    """

    token_ids: list[int]
    text: str
    logprobs: list[float]


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


@dataclass(frozen=True)
class WeightsUpdate:
    """What an ``UpdateWeights`` call did: the policy version now served, the seconds spent
    waiting for running samples and the seconds of the reload itself."""

    policy_version: int
    drain_seconds: float
    load_seconds: float


@dataclass(frozen=True)
class ServerStatus:
    """A rollout server's state (``GetStatus``).

    Attributes:
        geometry: The served model's routing geometry.
        policy_version: The policy version now served.
        max_model_len: The engine's longest sample, prompt and generation.
        running: Samples generating now.
        pending_writes: Record writes waiting or retrying; at most ``max_pending_writes``.
        counters: The server's counters by name (``docs/rollout_server.md``); one the server
            has not counted yet reads 0, as on the server.
    """

    geometry: Geometry
    policy_version: int
    max_model_len: int
    running: int
    pending_writes: int
    max_pending_writes: int
    counters: Counter[str] = field(default_factory=Counter)
