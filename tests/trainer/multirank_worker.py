"""One rank of a multi-rank replay check; launched by tests/trainer/parallel/test_multirank.py as

    torchrun --standalone --nproc-per-node N -m tests.trainer.multirank_worker \
        --layout dp2 --model-dir DIR --out FILE

Every rank builds the tiny model with CPU initialisation (same seed everywhere), takes only its
own data-parallel samples, reshards routes with ``trainer.sharding`` and checks:

- replaying the natural routes (recorded on this layout, turned into layout-free records and
  resharded back) gives a loss and gradients bit-identical to ``disabled``;
- with forced random routes (global, layout-free), the routing map of every router on every
  rank, gathered to rank 0, equals the unsharded expectation restricted to that rank's tokens
  and layers (an independent per-token computation on rank 0);
- with TP > 1: the loss equals TP1's (same world, groups rebuilt with TP1).

Pipeline-parallel layouts (``pp2*``, ``tp2sp_pp2``) run ``tests/trainer/multirank_pp.py``
instead (megatron's 1F1B or interleaved schedule). Rank 0 writes the outcome as JSON to
``--out``; the test asserts on it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import numpy as np
import torch
import torch.distributed as dist

from routereplay.domain.record import Geometry
from tests.support.replay import recording
from tests.trainer.helpers import capture_routing, grads, make_record, random_batch, random_routes
from trainer.distributed.world import World, init_world, model_overrides
from trainer.layout.align import align_routes, routes_from_recorded
from trainer.layout.batch import PaddedBatch
from trainer.model.build import build_model
from trainer.sharding import (
    Parallelism,
    PipelineSplit,
    check_stage_routers,
    dp_shard,
    padded_length,
    shard_padded,
    stage_moe_layers,
)

LAYOUTS = {
    "dp2": Parallelism(),
    "tp2sp": Parallelism(tp=2, sequence_parallel=True),
    "ep2": Parallelism(ep=2),
    "ep2_alltoall": Parallelism(ep=2),
    "tp2sp_ep2": Parallelism(tp=2, ep=2, etp=1, sequence_parallel=True),
    # A world that does not divide as configured: every rank must refuse it before any
    # collective (the test checks that both exit with the message, without hanging).
    "bad_tp4": Parallelism(tp=4, sequence_parallel=True),
    # Pipeline parallel, megatron's 1F1B schedule with 2 micro-batches (``run_pp``).
    "pp2": Parallelism(pp=2),
    "pp2_recompute": Parallelism(pp=2),
    # Virtual stages: megatron's interleaved 1F1B, 2 model chunks per rank (8-layer model).
    "pp2_vp2": Parallelism(pp=2, vp=2),
    "pp2_vp2_recompute": Parallelism(pp=2, vp=2),
    # 4 ranks.
    "tp2sp_pp2": Parallelism(tp=2, pp=2, sequence_parallel=True),
    "tp2sp_pp2_vp2_recompute": Parallelism(tp=2, pp=2, vp=2, sequence_parallel=True),
    "dp2_tp2sp_ep2": Parallelism(tp=2, ep=2, etp=1, sequence_parallel=True),
}
_FULL_RECOMPUTE = dict(
    recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
)
RECOMPUTE = {
    name: _FULL_RECOMPUTE
    for name in ("pp2_recompute", "pp2_vp2_recompute", "tp2sp_pp2_vp2_recompute")
}
DISPATCHER = {"ep2_alltoall": "alltoall"}
LENGTHS = [9, 6, 12, 7]  # the global batch; odd lengths on purpose
SEED = 1234
# For the demonstration in docs/resharding.md only: shift this rank's shard by one token.
SHIFT_ENV = "ROUTER_REPLAY_TEST_SHIFT_SHARD"


def _loss(model, batch: PaddedBatch) -> torch.Tensor:
    """Mean next-token cross-entropy over real (token, successor) pairs, through megatron's
    own (vocab-parallel) loss."""
    labels = torch.roll(batch.token_ids, -1, dims=1)
    valid = batch.valid
    pairs = valid & torch.roll(valid, -1, dims=1)
    pairs[:, -1] = False
    per_token = model(batch.token_ids, batch.position_ids(), batch.attention_mask(), labels=labels)
    return (per_token * pairs).sum() / pairs.sum()


def _pass(built, batch, indices=None):
    built.model.zero_grad(set_to_none=True)
    with built.replay.step():
        if indices is None:
            loss = _loss(built.model, batch)
            loss.backward()
        else:
            with built.replay.forward(indices):
                loss = _loss(built.model, batch)
            with built.replay.backward():
                loss.backward()
    return loss.detach(), grads(built.model)


def _build(model_dir, layout: Parallelism, world: World, dispatcher: str, **extra):
    torch.manual_seed(SEED)  # CPU initialisation draws full weights from the global generator
    built = build_model(
        model_dir,
        routing_replay=True,
        pg_collection=world.pg_collection,
        load_weights=False,
        use_cpu_initialization=True,
        # This dispatcher, whatever the trainer picks for the layout (both are checked here).
        **{**model_overrides(layout), "moe_token_dispatcher_type": dispatcher},
        **extra,
    )
    split = PipelineSplit.from_config(built.model.config)
    expected = stage_moe_layers(split, built.geometry.moe_layers, world.coords.pp_rank)
    check_stage_routers(expected, built.replay.layers, f"rank {world.rank}: ")
    return built


def _local_batch(world: World, layout: Parallelism) -> tuple[PaddedBatch, range]:
    mine = dp_shard(len(LENGTHS), world.dp_size, world.dp_rank)
    full = random_batch(SEED, LENGTHS, "right")
    seq = padded_length(max(LENGTHS), layout.multiple)
    tokens = [full.sample_tokens(b).numpy() for b in mine]
    ids = [full.sample_ids[b] for b in mine]
    return PaddedBatch.from_samples(ids, tokens, pad_id=1, max_length=seq), mine


def _shift(t: torch.Tensor, shift: int) -> torch.Tensor:
    return torch.roll(t, shift, dims=0) if shift else t


def _gather_tp(t: torch.Tensor, tp_group) -> torch.Tensor:
    """Concatenate a sequence-parallel shard over the TP group (rank order)."""
    size = dist.get_world_size(tp_group)
    if size == 1:
        return t
    parts = [torch.empty_like(t) for _ in range(size)]
    dist.all_gather(parts, t.contiguous(), group=tp_group)
    return torch.cat(parts)


def _records(batch, routes, geometry):
    return [
        make_record(batch.sample_ids[b], batch.sample_tokens(b).numpy(), routes[b], geometry)
        for b in range(batch.batch_size)
    ]


def _expected_maps(lengths, seq, routes, layers, geometry: Geometry):
    """Independent expectation for one DP rank's samples, unsharded: per layer a bool
    ``[seq * b, E]`` routing map and the bool ``[seq * b]`` rows that replay."""
    b = len(lengths)
    out = {}
    replayed = torch.zeros(seq * b, dtype=torch.bool)
    for layer in layers:
        j = geometry.moe_layers.index(layer)
        m = torch.zeros(seq * b, geometry.num_experts, dtype=torch.bool)
        for s, n in enumerate(lengths):
            for i in range(n - 1):  # right padding: token i at column i; the last has no row
                m[i * b + s, routes[s][i, j].astype(np.int64)] = True
                replayed[i * b + s] = True
        out[layer] = m
    return out, replayed


def run(layout_name: str, model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    layout = LAYOUTS[layout_name]
    world = init_world(layout, seed=SEED)
    from megatron.core import parallel_state

    tp_group = parallel_state.get_tensor_model_parallel_group()
    shift = 1 if os.environ.get(SHIFT_ENV) == "1" and world.rank == 1 else 0
    result: dict = {"layout": layout_name, "world_size": world.world_size, "checks": {}}
    result["dp_size"] = world.dp_size
    result["ep_size"] = parallel_state.get_expert_model_parallel_world_size()
    checks = result["checks"]
    t0 = time.perf_counter()
    built = _build(model_dir, layout, world, DISPATCHER.get(layout_name, "allgather"))
    geometry = built.geometry
    batch, mine = _local_batch(world, layout)
    seq = batch.seq_len

    def reshard(aligned):
        return [
            _shift(shard_padded(idx, seq, layout, world.coords), shift) for idx in aligned.indices
        ]

    # 1. natural routes: record on this layout -> layout-free records -> reshard -> replay.
    loss_off, grads_off = _pass(built, batch)
    recorded: list[list[torch.Tensor]] = []
    with torch.no_grad(), built.replay.step(), recording(built.replay, recorded):
        _loss(built.model, batch)
    full = [_gather_tp(r, tp_group) for r in recorded[0]]
    routes = routes_from_recorded(batch, full, geometry)
    aligned = align_routes(batch, _records(batch, routes, geometry), geometry, built.replay.layers)
    loss_on, grads_on = _pass(built, batch, reshard(aligned))
    same = torch.equal(loss_on, loss_off) and grads_on.keys() == grads_off.keys()
    same = same and all(torch.equal(grads_on[n], g) for n, g in grads_off.items())
    checks["natural_bit_identical"] = _all_ranks(same)
    checks["loss"] = float(loss_off)

    # 2. forced routes, global and layout-free; each rank replays its share.
    global_routes = [random_routes(100 + b, n - 1, geometry) for b, n in enumerate(LENGTHS)]
    mine_routes = [global_routes[b] for b in mine]
    aligned = align_routes(
        batch, _records(batch, mine_routes, geometry), geometry, built.replay.layers
    )
    built.model.zero_grad(set_to_none=True)
    with built.replay.step(), capture_routing(built.routers) as (maps, _):
        with built.replay.forward(reshard(aligned)):
            loss = _loss(built.model, batch)
        with built.replay.backward():
            loss.backward()
    router_grads = all(
        r.router.weight.grad is not None and bool(r.router.weight.grad.abs().sum() > 0)
        for r in built.routers
    )
    checks["router_grads_nonzero"] = _all_ranks(router_grads)
    local = {
        "rank": world.rank,
        "dp_rank": world.dp_rank,
        "tp_rank": world.coords.tp_rank,
        "pp_rank": world.coords.pp_rank,
        "maps": {layer: maps[layer][0] for layer in built.replay.layers},
    }
    gathered = [None] * world.world_size if world.rank == 0 else None
    dist.gather_object(local, gathered, dst=0)
    if world.rank == 0:
        checks["forced_maps"] = _compare_forced(gathered, world, layout, global_routes, geometry)

    # 3. TP > 1: same loss as TP1 (same seed, CPU initialisation), groups rebuilt in place.
    if layout.tp > 1:
        loss_tp = float(loss_off)
        parallel_state.destroy_model_parallel()
        tp1 = Parallelism(ep=layout.ep)
        world1 = init_world(tp1, seed=SEED)
        built1 = _build(model_dir, tp1, world1, DISPATCHER.get(layout_name, "allgather"))
        # The same samples as the TP2 run (TP2 had one DP rank: the whole batch).
        with torch.no_grad():
            loss1 = float(_loss(built1.model, batch))
        checks["tp1_loss"] = loss1
        checks["tp_loss_diff"] = abs(loss1 - loss_tp)
    result["seconds"] = time.perf_counter() - t0
    if world.rank == 0:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _all_ranks(ok: bool) -> bool:
    t = torch.tensor([int(ok)])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


def _compare_forced(gathered, world, layout, global_routes, geometry) -> dict:
    """Rank 0: put the shards back together per (DP rank, layer) and compare with the
    unsharded expectation on replayed rows."""
    seq = padded_length(max(LENGTHS), layout.multiple)
    mismatches: dict[str, int] = {}
    compared = 0
    layers_seen: set[int] = set()
    for dp_rank in range(world.dp_size):
        mine = dp_shard(len(LENGTHS), world.dp_size, dp_rank)
        lengths = [LENGTHS[b] for b in mine]
        shards = sorted(
            (g for g in gathered if g["dp_rank"] == dp_rank), key=lambda g: g["tp_rank"]
        )
        layers = sorted({layer for g in shards for layer in g["maps"]})
        layers_seen.update(layers)
        expected, replayed = _expected_maps(
            lengths, seq, [global_routes[b] for b in mine], layers, geometry
        )
        for layer in layers:
            got = torch.cat([g["maps"][layer] for g in shards if layer in g["maps"]])
            exp = expected[layer]
            if got.shape != exp.shape:
                mismatches[f"dp{dp_rank}/layer{layer}"] = -1
                continue
            bad = int((got[replayed] != exp[replayed]).any(dim=1).sum())
            compared += int(replayed.sum())
            if bad:
                mismatches[f"dp{dp_rank}/layer{layer}"] = bad
    return {
        "ok": not mismatches and layers_seen == set(geometry.moe_layers),
        "mismatched_rows": mismatches,
        "rows_compared": compared,
        "layers": sorted(layers_seen),
    }


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layout", choices=sorted(LAYOUTS), required=True)
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    try:
        if LAYOUTS[args.layout].pp > 1:
            from tests.trainer.multirank_pp import run_pp

            run_pp(args.layout, args.model_dir, args.out)
        else:
            run(args.layout, args.model_dir, args.out)
    except Exception:
        traceback.print_exc()
        sys.exit(1)


if __name__ == "__main__":
    main()
