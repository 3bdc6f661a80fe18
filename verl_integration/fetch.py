"""The trainer seam: each Megatron worker fetches its own samples' routes from the route cache
and builds ``batch["routed_experts"]`` as verl's rollout path would have shipped it.

verl's field: int16, one row per token aligned like ``input_ids`` (padded ``[bs, seq, L, k]``
with ``attention_mask``, or jagged ``[bs, j, L, k]`` beside jagged ``input_ids``), ``L`` =
``num_hidden_layers`` in vLLM's layout (one column per decoder layer, dense ones included, so
verl indexes it by absolute layer number), rows without a route (each sample's final token,
padding) zero. ``set_router_replay_data(..., model=chunk)`` reads only the columns of the chunk's
own routers, so a worker fetches only those (a layer-selected read, once per TP/CP group:
``trainer.data.stage_reads``) and leaves the other columns zero.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from routereplay.domain.model_geometry import MoEGeometry
from routereplay.domain.record import Record
from routereplay.domain.record_checks import (
    MissingRecord,
    absent_samples,
    check_geometry,
    first_turn_difference,
)
from routereplay.errors import NotFound

logger = logging.getLogger(__name__)

FETCHED_TTL_ENV = "ROUTER_REPLAY_FETCHED_TTL_S"
DEFAULT_FETCHED_TTL_S = 3600.0


class Routes(NamedTuple):
    """``routed_experts``: verl's field (see the module docstring). ``present``: bool ``[bs]``,
    False for samples without a record (``missing="native"``). ``routed``: bool per token, laid
    out like ``input_ids`` (jagged or padded), True on the rows that hold a recorded route; the
    others (a missing sample's, tokens past the record such as a tool's answer after the last
    generation, padding, rows past a divergence) are zero in the field and must route natively
    (``native_where_missing``). ``diverged``: int ``[bs]``, the record's rows left native
    because the batch's tokens differ from the record's before them (see
    ``RouteFetcher.routes``)."""

    routed_experts: torch.Tensor
    present: torch.Tensor
    routed: torch.Tensor
    diverged: torch.Tensor | None = None


class RouteFetcher:
    """One per trainer worker.

    Args:
        source: Where records come from: ``fetch(sample_ids) -> list[Record | None]``, e.g.
            ``worker_source(...)`` (this stage's layers, once per TP/CP group) or a
            ``trainer.data.source.CacheSource`` (whole records).
        geometry: The trained model's (``contract.served_geometry``): records of another model
            are refused.
        missing: ``"error"`` (default) raises ``NotFound`` naming the ids; ``"native"`` leaves
            their rows zero with ``present`` False.
    """

    def __init__(self, source, geometry: MoEGeometry, missing: str = "error"):
        self.source = source
        self.geometry = geometry
        self.missing = MissingRecord(missing)

    def records(self, sample_ids: Sequence[str | None]) -> list[Record | None]:
        """This worker's records, in order (None where missing and ``missing="native"``). A
        None id is a row not to replay (it trains nothing): not fetched, its record None."""
        ids = [None if s is None else str(s) for s in sample_ids]
        wanted = [s for s in ids if s is not None]
        fetched = iter(self.source.fetch(wanted) if wanted else [])
        records = [None if s is None else next(fetched) for s in ids]
        absent = [s for s in absent_samples(ids, records) if s is not None]
        if absent and self.missing is MissingRecord.ERROR:
            raise NotFound(
                f"no route record for sample(s) {absent} (expired, never written, or another "
                "route cache); set missing='native' to train them with native routing"
            )
        model = self.geometry.record
        for record in records:
            if record is not None:
                check_geometry(record.geometry, model, record.sample_id, model.model_id or None)
        return records

    def routes(self, sample_ids: Sequence[str], input_ids, attention_mask=None) -> Routes:
        """``batch["routed_experts"]`` for these samples.

        Args:
            sample_ids: One per row of ``input_ids`` (verl's ``non_tensor_batch`` id column);
                None for a row routed natively without a fetch (it trains nothing).
            input_ids: jagged ``[bs, j]`` (the result is jagged), or padded ``[bs, seq]`` with
                ``attention_mask`` (bool or 0/1 ``[bs, seq]``, True on real tokens).

        Token check: where the batch's tokens differ from the record's first at position ``d``,
        rows ``d`` on (whose prefix differs) are left native and counted in ``diverged``; only
        a difference inside the record's first turn (before its last token) is an error. verl's
        token builders may drop a stop token where a tool's answer follows a generation, so a
        later turn's history can differ from the record from that junction on; every row
        before ``d`` saw the recorded prefix and is exact.

        Raises:
            NotFound: a missing record with ``missing="error"``, naming it.
            InvalidArgument: a record of another model, or whose tokens differ from the
                sample's inside its first turn (another sample's record), naming it.
        """
        records = self.records(sample_ids)
        present = torch.tensor([r is not None for r in records], dtype=torch.bool)
        if input_ids.is_nested:
            tokens = list(input_ids.unbind())
            parts = [
                self._rows(r, t, s) for r, t, s in zip(records, tokens, sample_ids, strict=True)
            ]
            routed = [torch.arange(p.shape[0]) < rows for p, rows, _ in parts]
            return Routes(
                torch.nested.as_nested_tensor([p for p, _, _ in parts], layout=torch.jagged),
                present,
                torch.nested.as_nested_tensor(routed, layout=torch.jagged),
                torch.tensor([d for _, _, d in parts], dtype=torch.int64),
            )
        if attention_mask is None:
            raise ValueError("padded input_ids need their attention_mask")
        bs, seq = input_ids.shape
        out = torch.zeros(
            bs, seq, self.geometry.num_hidden_layers, self.geometry.record.topk, dtype=torch.int16
        )
        routed = torch.zeros(bs, seq, dtype=torch.bool)
        diverged = torch.zeros(bs, dtype=torch.int64)
        for b, (record, sample_id) in enumerate(zip(records, sample_ids, strict=True)):
            where = attention_mask[b].bool().nonzero().squeeze(1)
            out[b, where], rows, diverged[b] = self._rows(record, input_ids[b, where], sample_id)
            routed[b, where[:rows]] = True
        return Routes(out, present, routed, diverged)

    def _rows(self, record: Record | None, tokens: torch.Tensor, sample_id):
        """One sample's int16 ``[len(tokens), num_hidden_layers, k]``, how many leading rows
        hold a recorded route and how many of the record's rows a divergence left native."""
        n = tokens.shape[0]
        out = torch.zeros(
            n, self.geometry.num_hidden_layers, self.geometry.record.topk, dtype=torch.int16
        )
        if record is None:
            return out, 0, 0
        rows = min(record.num_rows, n)
        diverged = 0
        at = first_turn_difference(record, tokens.cpu().numpy(), sample_id)
        if at is not None:
            diverged = max(rows - at, 0)
            rows = min(rows, at)
            logger.log(
                logging.WARNING if diverged else logging.DEBUG,
                "sample %r: the batch's tokens differ from its route record's from position %d "
                "on (record %d tokens, batch %d); %d recorded rows from there route natively",
                sample_id,
                at,
                record.num_tokens,
                n,
                diverged,
            )
        routes = torch.from_numpy(np.ascontiguousarray(record.routes[:rows]))
        for column, start, stop in _runs(record.moe_layers):  # a stage's layers: one run
            out[:rows, column : column + stop - start].copy_(routes[:, start:stop])
        return out, rows, diverged


def _runs(layers) -> list[tuple[int, int, int]]:
    """Consecutive runs of the ascending layer numbers ``layers``: (first layer, start, stop)
    positions in ``layers``, so each run is copied as one slice, widening as it goes."""
    runs, start = [], 0
    for i in range(1, len(layers) + 1):
        if i == len(layers) or layers[i] != layers[i - 1] + 1:
            runs.append((layers[start], start, i))
            start = i
    return runs


def native_where_missing(replay_mask: torch.Tensor, routed: torch.Tensor) -> torch.Tensor:
    """verl's jagged replay mask (``build_r3_replay_mask``, which replays every row but each
    sample's last) cleared on the rows without a recorded route, so their routers choose
    natively instead of replaying the field's zeros (expert 0, k times).

    Args:
        replay_mask: jagged bool ``[bs, j]``.
        routed: jagged bool ``[bs, j]`` (``Routes.routed``).
    """
    values = replay_mask.values() & routed.values().to(replay_mask.device)
    return torch.nested.nested_tensor_from_jagged(values, offsets=replay_mask.offsets())


def router_layers(model) -> list[int]:
    """Global (0-based) layer numbers of the MoE routers in ``model`` (a megatron chunk or the
    list of a worker's virtual-stage chunks), ascending."""
    from megatron.core.transformer.moe.router import TopKRouter

    chunks = model if isinstance(model, list | tuple) else [model]
    layers = {
        m.layer_number - 1
        for chunk in chunks
        for m in getattr(chunk, "decoder", chunk).modules()
        if isinstance(m, TopKRouter) and m.layer_number is not None
    }
    return sorted(layers)


def fetched_ttl_s() -> float:
    """How long a record lives after a trainer worker fetched it (``$ROUTER_REPLAY_FETCHED_TTL_S``,
    default an hour; 0: its full time to live). verl has no ready feed to acknowledge, so this is
    how what it trained is freed: a step's passes (old log-probs, then each update epoch) read
    their records again well within it."""
    return float(os.environ.get(FETCHED_TTL_ENV, DEFAULT_FETCHED_TTL_S))


def worker_source(target: str, model, geometry: MoEGeometry, timeout_s: float = 60.0):
    """The route cache, read as this worker's stage needs it: only the MoE layers of ``model``'s
    routers, by one rank of each TP/CP group (the others receive the bytes over gloo).

    A collective over the world (every worker calls it, once): megatron's parallel state
    must be initialised. ``target``: the route cache's ``host:port``.
    """
    from megatron.core import parallel_state as mpu

    from trainer.data.source import CacheSource
    from trainer.data.stage_reads import StageReads, group_reads

    source = CacheSource(target, timeout_s=timeout_s, expire_after_s=fetched_ttl_s())
    moe = geometry.record.moe_layers
    mine = router_layers(model)
    layers = None if len(mine) == len(moe) else [moe.index(layer) for layer in mine]
    if mpu.get_tensor_model_parallel_world_size() * mpu.get_context_parallel_world_size() == 1:
        return StageReads(source, layers)
    place = (
        mpu.get_data_parallel_rank(),
        mpu.get_pipeline_model_parallel_rank(),
        mpu.get_tensor_model_parallel_rank(),
        mpu.get_context_parallel_rank(),
    )
    return group_reads(source, layers, place)
