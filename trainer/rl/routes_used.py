"""The routes a step's update passes used, as layout-free records (``router_replay.record_file``).

R3: the rollout's records, whole (stage reads hold each stage's layers: gathered over the
pipeline stages). R2 and disabled: what each router chose in the old-logprob pass, gathered
over the TP ranks' rows and the pipeline stages' layers, as records with the rollout's turns
and the trainer's log-probs. Every DP rank's records, in the single-rank order.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.distributed as dist

from routereplay.domain.record import Geometry, Record, Turn
from trainer.data.source import Sample
from trainer.distributed.dp import DataParallel
from trainer.layout import MicroBatch
from trainer.layout.align import routes_from_recorded
from trainer.rl import measure
from trainer.rl.stages import Observed, OldPass


def routes_used(
    mbs: list[MicroBatch],
    old: OldPass,
    *,
    rollout: bool,
    geometry: Geometry,
    dp: DataParallel,
    local_mini: int,
) -> list[Record]:
    """Every DP rank's records of the routes used, in the single-rank order.

    Args:
        mbs: This rank's micro-batches.
        old: The old-logprob pass (its natural routes and log-probs).
        rollout: The update passes replayed the rollout's routes (R3).
        geometry: The model's.
        dp: The data-parallel group (its ``model``: the model-parallel groups).
        local_mini: A mini-batch's samples on one DP rank.
    """
    per_sample = {}
    for m, mb in enumerate(mbs):
        if rollout:
            for j, rec in zip(mb.index, _whole_records(mb.records, dp.model), strict=True):
                if rec is not None:
                    per_sample[j] = rec
            continue
        whole = _whole_routes(old.routes[m], geometry, dp.model)
        routes = routes_from_recorded(mb.batch, whole, geometry)
        for b, (j, sample) in enumerate(zip(mb.index, mb.samples, strict=True)):
            lp = mb.batch.sample_values(old.logp[m], b).numpy()
            per_sample[j] = _record(sample, mb.records[b], routes[b], lp, geometry)
    return measure.in_batch_order(dp, local_mini, per_sample)


def _whole_routes(routes: Observed, geometry: Geometry, mp) -> list[torch.Tensor]:
    """Per MoE layer of the model, the micro-batch's chosen ids on every row."""
    mine = {}
    for layer, seen in routes.items():
        ids = seen["natural"]
        if mp is not None and mp.tp > 1:
            parts = [torch.empty_like(ids) for _ in range(mp.tp)]
            dist.all_gather(parts, ids.contiguous(), group=mp.tp_group)
            ids = torch.cat(parts)
        mine[layer] = ids
    if mp is not None and mp.pp_group is not None and mp.pp_group.size() > 1:
        stages = [None] * mp.pp_group.size()
        dist.all_gather_object(stages, mine, group=mp.pp_group)
        mine = {layer: ids for stage in stages for layer, ids in stage.items()}
    return [mine[layer] for layer in geometry.moe_layers]


def _whole_records(records: list[Record | None], mp) -> list[Record | None]:
    """The rollout's records with every MoE layer: stage reads hold each stage's layers
    (``trainer.data.stage_reads``), gathered here over the pipeline stages."""
    group = mp.pp_group if mp is not None else None
    selected = any(r is not None and r.layers is not None for r in records)
    # Every stage reads the same way: all take part in the gather or none does.
    if group is None or group.size() == 1 or not selected:
        return records
    parts = [None if r is None else (r.layers, r.routes) for r in records]
    stages = [None] * group.size()
    dist.all_gather_object(stages, parts, group=group)
    out = []
    for b, record in enumerate(records):
        if record is None or record.layers is None:
            out.append(record)
            continue
        g = record.geometry
        routes = np.empty((record.num_rows, g.num_moe_layers, g.topk), record.routes.dtype)
        for layers, part in (stage[b] for stage in stages):
            routes[:, list(layers)] = part
        out.append(dataclasses.replace(record, routes=routes, layers=None))
    return out


def _record(
    sample: Sample, rollout: Record | None, routes: np.ndarray, lp: np.ndarray, geometry: Geometry
) -> Record:
    """A sample's routes as a record (the rollout's turns, the trainer's log-probs)."""
    if rollout is not None:
        spans = [
            (t.token_start, t.token_end, t.generated_start, t.policy_version) for t in rollout.turns
        ]
    else:
        first = np.flatnonzero(sample.generated)
        gen = int(first[0]) if first.size else sample.token_ids.size
        spans = [(0, sample.token_ids.size, gen, 0)]
    turns = [Turn(s, e, g, v, lp[g:e].astype(np.float32)) for s, e, g, v in spans]
    return Record(sample.sample_id, geometry, sample.token_ids, routes, turns, sample.group_id)
