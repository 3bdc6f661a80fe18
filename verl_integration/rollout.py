"""The rollout seam: each ``generate()`` call of a sample becomes that sample's next turn in the
route cache, with the policy version that generated it.

verl's rollout server returns a ``TokenOutput`` whose ``routed_experts`` is
``[prompt + response (the last row may be absent), num_hidden_layers, k]``: one row per token
the engine ran, every decoder layer (dense ones included), computed by the weights loaded for
this call. In a multi-turn agent loop or a resumed partial rollout every call re-runs the whole
history, so its rows for the earlier turns come from the *current* policy, not the one that
generated those tokens; verl keeps the last call's tensor and so replays old turns with new
routes (verl #6054). Here only the rows of the tokens new in this call are stored, appended to
the record (``TurnAppend``): each turn keeps the routes of the policy that generated it.

Which record: verl's ``LLMServerClient`` sends the server a fresh request id on every call, so
the server alone cannot tell which sample a call continues. The agent loop's own id (one per
sample, kept across its turns and its partial-rollout resumes) is carried inside that request
id (``tag_request_id``, installed by ``verl_integration.plugin`` in verl's client), and the
server keys the record by it (``sample_of``). Before appending, the call's prompt is checked
against the record's tokens, content and length: a history that does not extend the record
(verl's GLM token builder replaces the record's last token) is rewritten from the first
difference (``rewritten``), never spliced and never refused, so one sample's history costs no
batch.

Stored rows: a record of T tokens holds T - 1 rows (the last token has no route until it is an
input); the append of a later call starts with the previous last token's row, computed in this
call, where that token was first an input.
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import logging
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np

from routereplay.domain.record import Record, Turn, TurnAppend
from routereplay.errors import FailedPrecondition, InvalidArgument, NotFound
from routereplay.families.model_geometry import MoEGeometry
from verl_integration.contract import ID_FIELD, route_cache_target, served_geometry

logger = logging.getLogger(__name__)


def moe_columns(
    routed_experts: Any, geometry: MoEGeometry, sample_id: str, rows: int
) -> np.ndarray:
    """The engine's capture reduced to what a record stores.

    Args:
        routed_experts: ``[>= rows, num_hidden_layers, k]`` expert ids (numpy, torch or
            nested lists), vLLM's layout.
        rows: Rows wanted (from row 0).

    Returns:
        ``[rows, len(moe_layers), k]`` in the geometry's dtype.

    Raises:
        InvalidArgument: naming the sample, for a capture of another model (layer count or k),
            too few rows, or expert ids out of range.
    """
    routes = np.asarray(routed_experts)
    want = (geometry.num_hidden_layers, geometry.record.topk)
    if routes.ndim != 3 or routes.shape[1:] != want:
        raise InvalidArgument(
            f"sample {sample_id!r}: routed_experts has shape {routes.shape}; the model "
            f"{geometry.record.model_id!r} needs [rows, num_hidden_layers={want[0]}, k={want[1]}]"
            " (is the rollout serving another model?)"
        )
    if routes.shape[0] < rows:
        raise InvalidArgument(
            f"sample {sample_id!r}: routed_experts has {routes.shape[0]} rows for {rows + 1} "
            "tokens; the engine returns one per token it ran (the last may be absent)"
        )
    moe = routes[:rows, list(geometry.record.moe_layers)]
    if moe.size and (moe.min() < 0 or moe.max() >= geometry.record.num_experts):
        bad = int(np.argmax((moe < 0) | (moe >= geometry.record.num_experts)))
        row = bad // (moe.shape[1] * moe.shape[2])
        raise InvalidArgument(
            f"sample {sample_id!r}: routed_experts row {row} has expert ids outside "
            f"[0, {geometry.record.num_experts}): {moe[row].tolist()}"
        )
    return moe.astype(geometry.record.dtype)


def next_turn(
    sample_id: str,
    tokens: np.ndarray,
    generated_start: int,
    output: Any,
    geometry: MoEGeometry,
    stored_tokens: int,
    policy_version: int,
) -> Record | TurnAppend:
    """What one ``generate()`` call adds to the sample's record.

    Args:
        tokens: int32 ``[T]``: the call's prompt (the whole history, earlier turns included)
            and the tokens it generated from ``generated_start`` on (at least one).
        output: verl's ``TokenOutput`` (``token_ids``, ``log_probs``, ``routed_experts``).
        stored_tokens: Tokens the route cache already holds for the sample (0: none), checked
            to be the prompt's first tokens (``TurnWriter.stored_tokens``).
        policy_version: The version of the weights that served the call.

    Returns:
        The new record (first call) or the turn to append.

    Raises:
        InvalidArgument: naming the sample: no routes, or a capture that does not fit the
            model.
    """
    if output.routed_experts is None:
        raise InvalidArgument(
            f"sample {sample_id!r}: the rollout returned no routed_experts; set "
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=True"
        )
    total = tokens.size
    logprobs = np.asarray(output.log_probs or [], dtype=np.float32)
    if logprobs.size != total - generated_start:
        logprobs = np.zeros(0, np.float32)  # not reported for every generated token
    routes = moe_columns(output.routed_experts, geometry, sample_id, total - 1)
    turn = Turn(stored_tokens, total, generated_start, int(policy_version), logprobs)
    if stored_tokens == 0:
        return Record(sample_id, geometry.record, tokens, routes, [turn])
    first_row = stored_tokens - 1  # the previous last token's row, computed now
    return TurnAppend(
        sample_id, geometry.record, first_row, tokens[stored_tokens:], routes[first_row:], [turn]
    )


def rewritten(
    old: Record,
    at: int,
    tokens: np.ndarray,
    generated_start: int,
    output: Any,
    geometry: MoEGeometry,
    policy_version: int | None = None,
) -> Record:
    """The record of a call whose prompt differs from the stored history ``old`` first at
    token ``at``: rows ``[0, at)`` from ``old`` (their tokens and every earlier one are
    unchanged), rows from ``at`` on from this call (``output``'s capture); the turns of ``old``
    cut at ``at``, then one turn for this call from ``at`` (the rewritten tokens are its prompt).

    Args:
        tokens: int32 ``[T]``: the call's prompt and the tokens it generated from
            ``generated_start`` on.
    """
    sample_id = old.sample_id
    version = _version(output, policy_version)
    fresh = next_turn(sample_id, tokens, generated_start, output, geometry, 0, version)
    routes = np.concatenate([old.routes[:at], fresh.routes[at:]])
    turns = []
    for turn in old.turns:
        if turn.token_start >= at:
            break
        end = min(turn.token_end, at)
        start = min(turn.generated_start, end)
        logprobs = turn.logprobs[: end - start] if turn.logprobs.size else turn.logprobs
        turns.append(Turn(turn.token_start, end, start, turn.policy_version, logprobs))
    last = fresh.turns[0]
    turns.append(Turn(at, tokens.size, generated_start, version, last.logprobs))
    return Record(sample_id, geometry.record, tokens, routes, turns, group_id=old.group_id)


def _version(output: Any, policy_version: int | None) -> int:
    """The given version, else the server's (verl sets ``extra_fields["global_steps"]``), else
    0 (before the first weight update)."""
    if policy_version is not None:
        return policy_version
    return int(output.extra_fields.get("global_steps") or 0)


def _digest(tokens: np.ndarray) -> bytes:
    return hashlib.blake2b(
        np.ascontiguousarray(tokens, dtype="<i4").tobytes(), digest_size=16
    ).digest()


async def _value(result):
    """A client call's result: awaited for the asyncio client, as is for the blocking one."""
    return await result if inspect.isawaitable(result) else result


class TurnWriter:
    """Writes each call's new rows to the route cache as the sample's next turn.

    Works over either client (``routereplay.rpc.client.RouteCacheClient`` or
    ``AsyncRouteCacheClient``): ``store`` is a coroutine, ``write`` its blocking form.
    The stored history comes from the route cache (``StatRecord``), so turns of one sample may
    be served by different processes; its content is checked against the call's prompt, from a
    digest remembered here when this process wrote the sample's last turn, else by reading the
    record's tokens back. The ready feed is not used (verl schedules its own batches): records
    are written ``more_turns`` and appends are never ``final``.

    Args:
        client: The route cache client.
        geometry: The served model's (``served_geometry``).
        remembered: Samples whose last written history this process keeps a digest of.
    """

    def __init__(self, client, geometry: MoEGeometry, remembered: int = 4096):
        self.client = client
        self.geometry = geometry
        self.remembered = remembered
        self._written: OrderedDict[str, tuple[int, bytes]] = OrderedDict()

    async def stored_tokens(self, sample_id: str, prompt: np.ndarray) -> tuple[int, int | None]:
        """Tokens the route cache holds for the sample (0: none), and the first position where
        ``prompt`` (int32 ``[P]``) differs from them (None: the record is the prompt's start;
        a record longer than the prompt differs at ``P`` at the latest)."""
        try:
            stored = (await _value(self.client.stat(sample_id))).num_tokens
        except NotFound:
            return 0, None
        if stored <= prompt.size and self._written.get(sample_id) == (
            stored,
            _digest(prompt[:stored]),
        ):
            return stored, None
        record = await _value(self.client.read(sample_id, layers=[0]))
        common = min(record.num_tokens, prompt.size)
        differ = np.flatnonzero(record.token_ids[:common] != prompt[:common])
        if differ.size:
            return record.num_tokens, int(differ[0])
        return record.num_tokens, None if record.num_tokens <= prompt.size else common

    async def store(
        self, sample_id: str, prompt_ids: Sequence[int], output: Any, policy_version=None
    ):
        """Store ``output``'s new tokens and rows as the sample's next turn.

        A prompt that rewrites the stored history (verl's GLM token builder replaces the
        record's last token at the assistant/tool junction; anything else that edits earlier
        tokens) costs no batch: the record is rewritten from the first difference ``d``
        (``rewritten``): rows before ``d`` are kept (their prefix is unchanged), the rest come
        from this call. At the record's last token nothing recorded is lost (a record of T
        tokens holds T - 1 rows); earlier, rows ``[d, T - 1)`` take this call's policy's routes
        for the rewritten tokens (a new segment from the common prefix), logged as a warning.

        Returns:
            The route cache's ``WriteResult``, or None when the call added nothing to store
            (an aborted or empty output).
        """
        if not _stores_anything(output):
            return None
        history = np.asarray([*prompt_ids, *output.token_ids], dtype=np.int32)
        generated_start = len(prompt_ids)
        stored, at = await self.stored_tokens(sample_id, history[:generated_start])
        version = _version(output, policy_version)
        if at is not None:
            result = await self._rewrite(
                sample_id, stored, at, history, generated_start, output, version
            )
            self._remember(sample_id, history)
            return result
        update = next_turn(
            sample_id, history, generated_start, output, self.geometry, stored, version
        )
        if isinstance(update, Record):
            result = await _value(self.client.write(update, more_turns=True))
        else:
            result = await _value(self.client.append(update))
        self._remember(sample_id, history)
        return result

    async def _rewrite(self, sample_id, stored, at, history, generated_start, output, version):
        """Replace the record by ``rewritten`` (delete, then write: the route cache never
        overwrites a record; a failure between them leaves the sample without a record)."""
        old = await _value(self.client.read(sample_id))
        record = rewritten(old, at, history, generated_start, output, self.geometry, version)
        logger.log(
            logging.INFO if at == stored - 1 else logging.WARNING,
            "sample %r: this call's prompt differs from the stored history at token %d of %d "
            "(%s); the record is rewritten from there: %d recorded rows kept, %d replaced",
            sample_id,
            at,
            stored,
            "its last token" if at == stored - 1 else "an earlier token",
            at,
            max(stored - 1 - at, 0),
        )
        await _value(self.client.delete(sample_id))
        return await _value(self.client.write(record, more_turns=True))

    def write(self, sample_id: str, prompt_ids: Sequence[int], output: Any, policy_version=None):
        """``store`` over the blocking client, from code that runs no event loop."""
        return asyncio.run(self.store(sample_id, prompt_ids, output, policy_version))

    def _remember(self, sample_id: str, tokens: np.ndarray) -> None:
        self._written[sample_id] = (tokens.size, _digest(tokens))
        self._written.move_to_end(sample_id)
        while len(self._written) > self.remembered:
            self._written.popitem(last=False)


def _stores_anything(output: Any) -> bool:
    """False for what verl returns when a request is aborted before it generated (no tokens,
    ``routed_experts=None``, ``stop_reason="aborted"``) or aborted without routes: passed
    through untouched; a resume or the next turn computes those rows."""
    if not output.token_ids:
        return False
    return not (output.routed_experts is None and output.stop_reason == "aborted")


def without_routes(output: Any, sample_id: str) -> Any:
    """``output`` as the drop-in returns it: no ``routed_experts`` (nothing for Ray to carry),
    the sample's id in ``extra_fields[ID_FIELD]``."""
    extra = {**output.extra_fields, ID_FIELD: sample_id}
    return output.model_copy(update={"routed_experts": None, "extra_fields": extra})


REQUEST_TAG = "rr:"
"""Prefix of a request id that carries its sample's id (``tag_request_id``)."""
VALIDATION_TAG = "rr-val:"
"""Prefix of a validation call's request id: its routes are never stored (validation never
trains, so its records would only wait out the route cache's TTL)."""


def tag_request_id(sample_id: str, request_id: str, validation: bool = False) -> str:
    """The request id verl sends the server (``request_id``: fresh per call, as vLLM needs),
    carrying the agent loop's per-sample id, which verl's client would otherwise drop."""
    return f"{VALIDATION_TAG if validation else REQUEST_TAG}{sample_id}:{request_id}"


def validation_sample_of(request_id: str) -> str | None:
    """The sample id carried by a validation call's request id, else None."""
    if not request_id.startswith(VALIDATION_TAG) or ":" not in request_id[len(VALIDATION_TAG) :]:
        return None
    return request_id[len(VALIDATION_TAG) :].rsplit(":", 1)[0]


def sample_of(request_id: str) -> str | None:
    """The sample id carried by a ``tag_request_id`` request id, else None."""
    if not request_id.startswith(REQUEST_TAG) or ":" not in request_id[len(REQUEST_TAG) :]:
        return None
    return request_id[len(REQUEST_TAG) :].rsplit(":", 1)[0]


class RouteCacheGenerate:
    """Drop-in for verl's rollout server class: ``generate()`` writes the call's turn to the
    route cache and returns the output without routes, its sample id in ``extra_fields``.

    Mix it in front of verl's server (``class Server(RouteCacheGenerate, vLLMHttpServer)``; see
    ``route_cache_replica``). The sample id comes from the request id (``sample_of``); a request
    that carries none is refused (the plugin is not loaded in the agent loop's process, or
    ``full_determinism`` gives every sample one id). Aborted and empty outputs store nothing
    and pass through untouched but for the sample's id in ``extra_fields`` (verl's agent loop
    keeps the first call's, which may be an abort before the first token). The route cache is
    ``contract.route_cache_target``'s; the geometry is read from the served model's
    ``config.json`` (``self.model_config.local_path``), unless ``route_writer`` is set first.
    """

    route_writer: TurnWriter | None = None

    def _route_writer(self) -> TurnWriter:
        if self.route_writer is None:
            from routereplay.rpc.client import AsyncRouteCacheClient

            target = route_cache_target(getattr(self.config, "custom", None))
            if target is None:
                raise FailedPrecondition(
                    "no route cache: set actor_rollout_ref.rollout.custom.route_cache=host:port "
                    "in verl's config (or ROUTER_REPLAY_CACHE in the rollout servers' environment)"
                )
            self.route_writer = TurnWriter(
                AsyncRouteCacheClient(target), served_geometry(self.model_config.local_path)
            )
        return self.route_writer

    def sample_id_of(self, request_id: str) -> str | None:
        """The record this call continues: the agent loop's sample id (``sample_of``)."""
        return sample_of(request_id)

    async def generate(self, prompt_ids, sampling_params, request_id, **kwargs):
        validation = validation_sample_of(request_id)
        if validation is not None:  # never trained: nothing stored, nothing for Ray to carry
            output = await super().generate(prompt_ids, sampling_params, request_id, **kwargs)
            return without_routes(output, validation)
        sample_id = self.sample_id_of(request_id)
        if sample_id is None:
            raise FailedPrecondition(
                f"request {request_id!r} carries no sample id, so its routes cannot be stored: "
                "load verl_integration in the agent loop workers (installing router-replay "
                "registers its verl.plugins entry point) and keep "
                "actor_rollout_ref.rollout.full_determinism=False"
            )
        output = await super().generate(prompt_ids, sampling_params, request_id, **kwargs)
        if not _stores_anything(output):  # still carries the id: verl keeps the first call's
            extra = {**output.extra_fields, ID_FIELD: sample_id}
            return output.model_copy(update={"extra_fields": extra})
        await self._route_writer().store(sample_id, prompt_ids, output)
        return without_routes(output, sample_id)


def converts(replica) -> bool:
    """Whether a replica's servers store routes: the actor's rollout (not a reward model's or
    an on-policy-distillation teacher's), with routing replay on (not the generation server)."""
    return (
        not replica.is_reward_model
        and not replica.is_teacher_model
        and bool(replica.config.enable_rollout_routing_replay)
    )


def route_cache_replica(replica_cls, server_cls):
    """A subclass of verl's rollout replica (e.g. ``vLLMReplica``) whose servers are
    ``server_cls`` (e.g. ``vLLMHttpServer``) with ``RouteCacheGenerate`` in front, where
    ``converts`` says so; every other replica keeps verl's server."""
    import ray

    server = type(f"RouteCache{server_cls.__name__}", (RouteCacheGenerate, server_cls), {})

    class RouteCacheReplica(replica_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if converts(self):
                self.server_class = ray.remote(server)

    RouteCacheReplica.__name__ = f"RouteCache{replica_cls.__name__}"
    return RouteCacheReplica
