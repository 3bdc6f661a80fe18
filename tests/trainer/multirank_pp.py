"""Pipeline-parallel part of ``tests/trainer/multirank_worker.py``: PP2 under megatron's own
schedule (``get_forward_backward_func``: 1F1B, or interleaved 1F1B with virtual stages), 2
micro-batches of 2 samples, with or without activation recompute, optionally with TP2 + SP.

Each model chunk replays only its own routers (``reshard.stage_moe_layers`` of its pipeline
rank and virtual stage); the forward step runs the chunk the schedule hands it inside that
chunk's ``RouterReplayControl.forward`` with that micro-batch's ids, and
``trainer.rl.schedule.replay_backward`` puts every ``backward_step`` of the schedule under
``REPLAY_BACKWARD``. Checks:

- natural routes (recorded through the same schedule, gathered over the TP shards and the
  stages into layout-free records, resharded back per chunk) give bit-identical loss and grads
  to ``disabled``;
- forced routes: every router call of every chunk (forward, and the recompute in backward),
  its TP shards gathered to rank 0, equals the global forced routes of that micro-batch's
  samples and that router's layer;
- with recompute, the trap: leaving ``REPLAY_FORWARD`` on through the schedule's backward (no
  ``REPLAY_BACKWARD``) changes the gradients of the stage that recomputes micro-batch 0 after
  micro-batch 1's forward (stage 0 under 1F1B).
"""

from __future__ import annotations

import contextlib
import functools
import json
import time

import torch
import torch.distributed as dist

from tests.support.replay import recording
from tests.trainer.helpers import capture_routing, grads, random_batch, random_routes
from tests.trainer.multirank_worker import (
    LAYOUTS,
    LENGTHS,
    RECOMPUTE,
    SEED,
    _all_ranks,
    _build,
    _expected_maps,
    _gather_tp,
    _records,
)
from trainer.distributed.world import init_world, model_overrides
from trainer.layout.align import align_routes, routes_from_recorded
from trainer.layout.batch import PaddedBatch
from trainer.model.build import TrainerModel, build_model
from trainer.model.replay import RouterReplayAction
from trainer.rl.schedule import replay_backward
from trainer.sharding import padded_length, shard_padded

MICRO_BATCH = 2  # samples per micro-batch: 2 micro-batches of the 4 samples


def _micro_batches(seq: int) -> list[tuple[range, PaddedBatch]]:
    full = random_batch(SEED, LENGTHS, "right")
    out = []
    for start in range(0, len(LENGTHS), MICRO_BATCH):
        mine = range(start, start + MICRO_BATCH)
        tokens = [full.sample_tokens(b).numpy() for b in mine]
        ids = [full.sample_ids[b] for b in mine]
        out.append((mine, PaddedBatch.from_samples(ids, tokens, pad_id=1, max_length=seq)))
    return out


def _pairs(batch: PaddedBatch) -> torch.Tensor:
    valid = batch.valid
    pairs = valid & torch.roll(valid, -1, dims=1)
    pairs[:, -1] = False
    return pairs


class _Schedule:
    """One step of megatron's pipeline schedule (1F1B, or interleaved 1F1B with virtual stages)
    over the micro-batches, replay driven per micro-batch and model chunk."""

    def __init__(self, chunks: TrainerModel, micro_batches, total_pairs: int):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.chunks = chunks
        self.micro_batches = micro_batches
        self.total_pairs = total_pairs
        self.func = get_forward_backward_func()
        # Called after each micro-batch's forward (with its index) and each backward_step.
        self.on_forward = None
        self.on_backward = None

    def _loss(self, pairs, per_token):
        loss = (per_token * pairs).sum() / self.total_pairs * len(self.micro_batches)
        return loss, {"loss": loss.detach()}

    def run(self, indices=None, *, forward_only=False, mode="replay", record_into=None):
        """``indices``: per chunk, per micro-batch its router tensors (None: natural routing).
        ``mode``: "replay" (forward context + REPLAY_BACKWARD) or "trap" (REPLAY_FORWARD left
        on). ``record_into``: per chunk, per micro-batch what its routers chose."""
        chunks = self.chunks
        n = len(self.micro_batches)

        def forward_step(data_iterator, model):
            mb = next(data_iterator)  # each chunk runs the micro-batches in order
            v = chunks.vp_stage(model)
            control = chunks.controls[v]
            batch = self.micro_batches[mb][1]
            labels = torch.roll(batch.token_ids, -1, dims=1)
            if record_into is not None:
                ctx = recording(control, record_into[v])
            elif indices is None:
                ctx = contextlib.nullcontext()
            elif mode == "trap":
                control.load(indices[v][mb])
                control._set_action(RouterReplayAction.REPLAY_FORWARD)
                ctx = contextlib.nullcontext()
            else:
                ctx = control.forward(indices[v][mb])
            with ctx:
                out = model(
                    batch.token_ids, batch.position_ids(), batch.attention_mask(), labels=labels
                )
            if self.on_forward is not None:
                self.on_forward(mb)
            return out, functools.partial(self._loss, _pairs(batch))

        for model in chunks.chunks:
            model.zero_grad(set_to_none=True)
        replaying = indices is not None and mode == "replay"
        backward = replay_backward(chunks.replay) if replaying else contextlib.nullcontext()
        grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
        seq = self.micro_batches[0][1].seq_len
        with chunks.replay.step(), backward, self._observe_backward(), grad_ctx:
            losses = self.func(
                forward_step_func=forward_step,
                data_iterator=[iter(range(n)) for _ in chunks.chunks],
                model=chunks.chunks,
                num_microbatches=n,
                seq_length=seq,
                micro_batch_size=MICRO_BATCH,
                forward_only=forward_only,
            )
        loss = sum(float(d["loss"]) for d in losses) if losses else None
        if forward_only:
            return loss, None
        every = {
            f"{v}.{name}": g for v, m in enumerate(chunks.chunks) for name, g in grads(m).items()
        }
        return loss, every

    @contextlib.contextmanager
    def _observe_backward(self):
        """Call ``on_backward`` after each of the schedule's ``backward_step`` (wrapping the
        replay wrapper when it is installed)."""
        if self.on_backward is None:
            yield
            return
        from megatron.core.pipeline_parallel import schedules

        inner = schedules.backward_step

        def backward_step(*args, **kwargs):
            out = inner(*args, **kwargs)
            self.on_backward()
            return out

        schedules.backward_step = backward_step
        try:
            yield
        finally:
            schedules.backward_step = inner


def _build_chunks(model_dir, layout, world, **extra) -> TrainerModel:
    """This rank's model chunks (one without virtual stages)."""
    if layout.vp is None:
        return _build(model_dir, layout, world, "allgather", **extra)
    torch.manual_seed(SEED)
    return build_model(
        model_dir,
        routing_replay=True,
        load_weights=False,
        pg_collection=world.pg_collection,
        moe_token_dispatcher_type="allgather",
        **model_overrides(layout),
        **extra,
    )


def run_pp(layout_name: str, model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    layout = LAYOUTS[layout_name]
    recompute = layout_name in RECOMPUTE
    world = init_world(layout, seed=SEED)
    from megatron.core import parallel_state

    pp_group = parallel_state.get_pipeline_model_parallel_group()
    tp_group = parallel_state.get_tensor_model_parallel_group()
    result: dict = {"layout": layout_name, "world_size": world.world_size, "checks": {}}
    checks = result["checks"]
    t0 = time.perf_counter()
    chunks = _build_chunks(model_dir, layout, world, **RECOMPUTE.get(layout_name, {}))
    geometry = chunks.geometry
    layers = chunks.replay.layers
    seq = padded_length(max(LENGTHS), layout.multiple)
    micro_batches = _micro_batches(seq)
    total_pairs = int(sum(_pairs(b).sum() for _, b in micro_batches))
    sched = _Schedule(chunks, micro_batches, total_pairs)
    checks["schedule"] = sched.func.__name__

    def stage_indices(routes_per_sample):
        """Per chunk, per micro-batch: this rank's share (its chunk's layers, its SP rows)."""
        out = []
        for control in chunks.controls:
            per_mb = []
            for mine, batch in micro_batches:
                recs = _records(batch, [routes_per_sample[b] for b in mine], geometry)
                aligned = align_routes(batch, recs, geometry, control.layers)
                per_mb.append([shard_padded(i, seq, layout, world.coords) for i in aligned.indices])
            out.append(per_mb)
        return out

    # 1. natural routes: record through the schedule, gather the TP shards and the stages'
    # layers, make layout-free records, reshard back to each chunk's layers, replay.
    loss_off, grads_off = sched.run()
    recorded: list[list[list[torch.Tensor]]] = [[] for _ in chunks.chunks]
    sched.run(forward_only=True, record_into=recorded)
    mine_rec = {
        layer: [_gather_tp(per_mb[j], tp_group) for per_mb in recorded[v]]
        for v, control in enumerate(chunks.controls)
        for j, layer in enumerate(control.layers)
    }
    every = [None] * dist.get_world_size(pp_group)
    dist.all_gather_object(every, mine_rec, group=pp_group)
    by_layer = {layer: mbs for stage in every for layer, mbs in stage.items()}
    natural: dict[int, object] = {}
    for m, (mine, batch) in enumerate(micro_batches):
        per_layer = [by_layer[layer][m] for layer in geometry.moe_layers]
        for b, routes in zip(mine, routes_from_recorded(batch, per_layer, geometry), strict=True):
            natural[b] = routes
    loss_on, grads_on = sched.run(stage_indices(natural))
    same = loss_on == loss_off and grads_on.keys() == grads_off.keys()
    same = same and all(torch.equal(grads_on[n], g) for n, g in grads_off.items())
    checks["natural_bit_identical"] = _all_ranks(same)
    owned = [None] * world.world_size
    chunk_layers = {v: list(c.layers) for v, c in enumerate(chunks.controls)}
    dist.all_gather_object(owned, (world.coords.pp_rank, list(layers), chunk_layers))
    checks["stage_layers"] = {str(p): ls for p, ls, _ in owned}
    checks["chunk_layers"] = {f"{p}/{v}": ls for p, _, c in owned for v, ls in c.items()}

    # 2. forced routes: every router call, forward and recompute, per micro-batch.
    global_routes = [random_routes(100 + b, n - 1, geometry) for b, n in enumerate(LENGTHS)]
    forced = stage_indices(global_routes)
    calls: dict[int, dict[int, list[torch.Tensor]]] = {layer: {} for layer in layers}
    with capture_routing(chunks.routers) as (maps, _):
        seen = {layer: 0 for layer in layers}
        recomputed = {layer: 0 for layer in layers}

        def new_calls(layer):
            got = maps[layer][seen[layer] :]
            seen[layer] = len(maps[layer])
            return got

        def on_forward(mb):
            for layer in layers:  # only the chunk that just ran has new calls
                calls[layer].setdefault(mb, []).extend(new_calls(layer))

        def on_backward():
            # A chunk runs its micro-batches' backwards in forward order, so a router's n-th
            # recompute is micro-batch n's (if not, the natural replay above differs).
            for layer in layers:
                for call in new_calls(layer):
                    calls[layer].setdefault(recomputed[layer], []).append(call)
                    recomputed[layer] += 1

        sched.on_forward, sched.on_backward = on_forward, on_backward
        try:
            _, grads_forced = sched.run(forced)
        finally:
            sched.on_forward = sched.on_backward = None
    router_grads = all(
        r.router.weight.grad is not None and bool(r.router.weight.grad.abs().sum() > 0)
        for r in chunks.routers
    )
    checks["router_grads_nonzero"] = _all_ranks(router_grads)
    local = {"pp_rank": world.coords.pp_rank, "tp_rank": world.coords.tp_rank, "calls": calls}
    gathered = [None] * world.world_size if world.rank == 0 else None
    dist.gather_object(local, gathered, dst=0)
    if world.rank == 0:
        checks["forced_maps"] = _compare(gathered, global_routes, geometry, seq, recompute)

    # 3. the trap (recompute only): REPLAY_FORWARD left on through backward.
    if recompute:
        _, grads_trap = sched.run(forced, mode="trap")
        differs = any(not torch.equal(grads_trap[n], g) for n, g in grads_forced.items())
        every_differs = [None] * world.world_size
        dist.all_gather_object(every_differs, (world.coords.pp_rank, differs))
        checks["trap_grads_differ"] = {str(p): d for p, d in every_differs}
    result["seconds"] = time.perf_counter() - t0
    if world.rank == 0:
        with open(out, "w") as f:
            json.dump(result, f, indent=2)
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def _compare(gathered, global_routes, geometry, seq, recompute) -> dict:
    """Rank 0: every call of every router, per micro-batch, against the forced routes."""
    mismatches: dict[str, int] = {}
    compared = 0
    layers_seen: set[int] = set()
    calls_per_mb = 2 if recompute else 1
    stages: dict[int, list] = {}
    for g in sorted(gathered, key=lambda g: (g["pp_rank"], g["tp_rank"])):
        stages.setdefault(g["pp_rank"], []).append(g["calls"])
    for pp_rank, shards in stages.items():
        for layer in shards[0]:
            layers_seen.add(layer)
            for m in range(len(LENGTHS) // MICRO_BATCH):
                mine = range(m * MICRO_BATCH, (m + 1) * MICRO_BATCH)
                expected, replayed = _expected_maps(
                    [LENGTHS[b] for b in mine],
                    seq,
                    [global_routes[b] for b in mine],
                    [layer],
                    geometry,
                )
                got = _join_tp([shard[layer].get(m, []) for shard in shards])
                if len(got) != calls_per_mb:
                    mismatches[f"pp{pp_rank}/layer{layer}/mb{m}/calls"] = len(got)
                    continue
                for c, g in enumerate(got):
                    bad = int((g[replayed] != expected[layer][replayed]).any(dim=1).sum())
                    compared += int(replayed.sum())
                    if bad:
                        mismatches[f"pp{pp_rank}/layer{layer}/mb{m}/call{c}"] = bad
    return {
        "ok": not mismatches and layers_seen == set(geometry.moe_layers),
        "mismatched_rows": mismatches,
        "rows_compared": compared,
        "layers": sorted(layers_seen),
    }


def _join_tp(per_tp_rank: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """One router's calls on one micro-batch, each call's sequence-parallel shards concatenated
    in TP rank order (no calls when the TP ranks saw different numbers of calls)."""
    if len({len(calls) for calls in per_tp_rank}) != 1:
        return []
    return [torch.cat(parts) for parts in zip(*per_tp_rank, strict=True)]
