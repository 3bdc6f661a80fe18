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

Stored rows: a record of T tokens holds T - 1 rows (the last token has no route until it is an
input); the append of a later call starts with the previous last token's row, computed in this
call, where that token was first an input.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from routereplay.domain.model_geometry import MoEGeometry, load_geometry
from routereplay.domain.record import Record, Turn, TurnAppend
from routereplay.errors import InvalidArgument, NotFound

ID_FIELD = "route_cache_id"
"""``TokenOutput.extra_fields`` key under which the drop-in returns the sample's route cache id;
verl's agent loop turns extra fields into ``non_tensor_batch`` columns of the same name."""


def served_geometry(model_dir: str) -> MoEGeometry:
    """The geometry of the model in ``model_dir`` (its ``config.json``), named by the folder's
    name: what the rollout side writes and the trainer side checks records against."""
    return load_geometry(model_dir, os.path.basename(os.path.normpath(model_dir)))


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
    prompt_ids: Sequence[int],
    output: Any,
    geometry: MoEGeometry,
    stored_tokens: int,
    policy_version: int,
) -> Record | TurnAppend | None:
    """What one ``generate()`` call adds to the sample's record.

    Args:
        prompt_ids: The call's prompt: the whole history (earlier turns included).
        output: verl's ``TokenOutput`` (``token_ids``, ``log_probs``, ``routed_experts``).
        stored_tokens: Tokens the route cache already holds for the sample (0: none).
        policy_version: The version of the weights that served the call.

    Returns:
        The new record (first call), the turn to append, or None when the call added no token.

    Raises:
        InvalidArgument: naming the sample: no routes, a history that does not extend the
            stored tokens, or a capture that does not fit the model.
    """
    if output.routed_experts is None:
        raise InvalidArgument(
            f"sample {sample_id!r}: the rollout returned no routed_experts; set "
            "actor_rollout_ref.rollout.enable_rollout_routing_replay=True"
        )
    tokens = np.asarray([*prompt_ids, *output.token_ids], dtype=np.int32)
    total, generated_start = tokens.size, len(prompt_ids)
    if stored_tokens > generated_start:
        raise InvalidArgument(
            f"sample {sample_id!r}: the route cache holds {stored_tokens} tokens but this call's "
            f"prompt has {generated_start}: a turn must extend the stored history"
        )
    if total == stored_tokens:
        return None
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


def _version(output: Any, policy_version: int | None) -> int:
    """The given version, else the server's (verl sets ``extra_fields["global_steps"]``), else
    0 (before the first weight update)."""
    if policy_version is not None:
        return policy_version
    return int(output.extra_fields.get("global_steps") or 0)


class TurnWriter:
    """Writes each call's new rows to the route cache (blocking client).

    Stateless: the stored length comes from the route cache (``StatRecord``), so turns of one
    sample may be served by different processes. The ready feed is not used (verl schedules
    its own batches): records are written ``more_turns`` and appends are never ``final``.

    Args:
        client: A ``routereplay.rpc.client.RouteCacheClient``.
        geometry: The served model's (``served_geometry``).
    """

    def __init__(self, client, geometry: MoEGeometry):
        self.client = client
        self.geometry = geometry

    def stored_tokens(self, sample_id: str) -> int:
        try:
            return self.client.stat(sample_id).num_tokens
        except NotFound:
            return 0

    def write(self, sample_id: str, prompt_ids: Sequence[int], output: Any, policy_version=None):
        """Store ``output``'s new tokens and rows as the sample's next turn.

        Returns:
            The route cache's ``WriteResult``, or None when the call added no token.
        """
        stored = self.stored_tokens(sample_id)
        update = next_turn(
            sample_id, prompt_ids, output, self.geometry, stored, _version(output, policy_version)
        )
        if update is None:
            return None
        if isinstance(update, Record):
            return self.client.write(update, more_turns=True)
        return self.client.append(update)


class AsyncTurnWriter(TurnWriter):
    """``TurnWriter`` over a ``routereplay.rpc.client.AsyncRouteCacheClient`` (for verl's
    asyncio rollout servers)."""

    async def stored_tokens(self, sample_id: str) -> int:
        try:
            return (await self.client.stat(sample_id)).num_tokens
        except NotFound:
            return 0

    async def write(
        self, sample_id: str, prompt_ids: Sequence[int], output: Any, policy_version=None
    ):
        stored = await self.stored_tokens(sample_id)
        update = next_turn(
            sample_id, prompt_ids, output, self.geometry, stored, _version(output, policy_version)
        )
        if update is None:
            return None
        if isinstance(update, Record):
            return await self.client.write(update, more_turns=True)
        return await self.client.append(update)


def without_routes(output: Any, sample_id: str) -> Any:
    """``output`` as the drop-in returns it: no ``routed_experts`` (nothing for Ray to carry),
    the sample's id in ``extra_fields[ID_FIELD]``."""
    extra = {**output.extra_fields, ID_FIELD: sample_id}
    return output.model_copy(update={"routed_experts": None, "extra_fields": extra})


class RouteCacheGenerate:
    """Drop-in for verl's rollout server class: ``generate()`` writes the call's turn to the
    route cache and returns the output without routes, its id in ``extra_fields``.

    Mix it in front of verl's server (``class Server(RouteCacheGenerate, vLLMHttpServer)``; see
    ``route_cache_replica``). The sample id is verl's ``request_id``, which its agent loops keep
    for every turn of a sample (and its partial-rollout resumes reuse). The route cache target
    is ``$ROUTER_REPLAY_CACHE`` (``host:port``); the geometry is read from the served model's
    ``config.json`` (``self.model_config.local_path``), unless ``route_writer`` is set first.
    """

    route_writer: AsyncTurnWriter | None = None

    def _route_writer(self) -> AsyncTurnWriter:
        if self.route_writer is None:
            from routereplay.rpc.client import AsyncRouteCacheClient

            target = os.environ.get("ROUTER_REPLAY_CACHE")
            if not target:
                raise InvalidArgument(
                    "ROUTER_REPLAY_CACHE is not set: give the route cache's host:port to the "
                    "rollout servers' environment"
                )
            self.route_writer = AsyncTurnWriter(
                AsyncRouteCacheClient(target), served_geometry(self.model_config.local_path)
            )
        return self.route_writer

    async def generate(self, prompt_ids, sampling_params, request_id, **kwargs):
        output = await super().generate(prompt_ids, sampling_params, request_id, **kwargs)
        await self._route_writer().write(request_id, prompt_ids, output)
        return without_routes(output, request_id)


def route_cache_replica(replica_cls, server_cls):
    """A subclass of verl's rollout replica (e.g. ``vLLMReplica``) whose servers are
    ``server_cls`` (e.g. ``vLLMHttpServer``) with ``RouteCacheGenerate`` in front."""
    import ray

    server = type(f"RouteCache{server_cls.__name__}", (RouteCacheGenerate, server_cls), {})

    class RouteCacheReplica(replica_cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.server_class = ray.remote(server)

    RouteCacheReplica.__name__ = f"RouteCache{replica_cls.__name__}"
    return RouteCacheReplica
