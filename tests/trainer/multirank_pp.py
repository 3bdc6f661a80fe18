"""Pipeline-parallel part of ``tests/trainer/multirank_worker.py``: PP2 under megatron's 1F1B
schedule (``get_forward_backward_func``), 2 micro-batches of 2 samples, with or without
activation recompute.

Each stage replays only its own routers (``reshard.stage_moe_layers``); the forward step runs
the model inside ``RouterReplayControl.forward`` with that micro-batch's ids, and
``trainer.pipeline.replay_backward`` puts every ``backward_step`` of the schedule under
``REPLAY_BACKWARD``. Checks:

- natural routes (recorded through the same schedule, gathered over the stages into
  layout-free records, resharded back per stage) give bit-identical loss and grads to
  ``disabled``;
- forced routes: every router call of every stage (forward, and the recompute in backward),
  gathered to rank 0, equals the global forced routes of that micro-batch's samples and that
  stage's layers;
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

from tests.trainer.helpers import capture_routing, grads, random_batch, random_routes
from tests.trainer.multirank_worker import (
    LAYOUTS,
    LENGTHS,
    RECOMPUTE,
    SEED,
    _all_ranks,
    _build,
    _expected_maps,
    _records,
)
from trainer import parallel
from trainer.align import align_routes, routes_from_recorded
from trainer.batch import PaddedBatch
from trainer.pipeline import replay_backward
from trainer.replay import RouterReplayAction
from trainer.reshard import shard_padded

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
    """One 1F1B step over the micro-batches, replay driven per micro-batch."""

    def __init__(self, built, micro_batches, total_pairs: int):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        self.built = built
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
        """``indices``: per micro-batch this stage's router tensors (None: natural routing).
        ``mode``: "replay" (forward context + REPLAY_BACKWARD) or "trap" (REPLAY_FORWARD left
        on). ``record_into``: per micro-batch, what this stage's routers chose."""
        replay = self.built.replay
        data = iter(range(len(self.micro_batches)))

        def forward_step(data_iterator, model):
            mb = next(data_iterator)
            batch = self.micro_batches[mb][1]
            labels = torch.roll(batch.token_ids, -1, dims=1)
            if record_into is not None:
                ctx = replay.recording(record_into)
            elif indices is None:
                ctx = contextlib.nullcontext()
            elif mode == "trap":
                replay.load(indices[mb])
                replay._set_action(RouterReplayAction.REPLAY_FORWARD)
                ctx = contextlib.nullcontext()
            else:
                ctx = replay.forward(indices[mb])
            with ctx:
                out = model(
                    batch.token_ids, batch.position_ids(), batch.attention_mask(), labels=labels
                )
            if self.on_forward is not None:
                self.on_forward(mb)
            return out, functools.partial(self._loss, _pairs(batch))

        self.built.model.zero_grad(set_to_none=True)
        replaying = indices is not None and mode == "replay"
        backward = replay_backward(replay) if replaying else contextlib.nullcontext()
        grad_ctx = torch.no_grad() if forward_only else contextlib.nullcontext()
        seq = self.micro_batches[0][1].seq_len
        with replay.step(), backward, self._observe_backward(), grad_ctx:
            losses = self.func(
                forward_step_func=forward_step,
                data_iterator=data,
                model=[self.built.model],
                num_microbatches=len(self.micro_batches),
                seq_length=seq,
                micro_batch_size=MICRO_BATCH,
                forward_only=forward_only,
            )
        loss = sum(float(d["loss"]) for d in losses) if losses else None
        return loss, (None if forward_only else grads(self.built.model))

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


def run_pp(layout_name: str, model_dir: str, out: str) -> None:
    torch.set_num_threads(1)
    layout = LAYOUTS[layout_name]
    recompute = layout_name in RECOMPUTE
    world = parallel.init_world(layout, seed=SEED)
    from megatron.core import parallel_state

    pp_group = parallel_state.get_pipeline_model_parallel_group()
    result: dict = {"layout": layout_name, "world_size": world.world_size, "checks": {}}
    checks = result["checks"]
    t0 = time.perf_counter()
    built = _build(model_dir, layout, world, "allgather", **RECOMPUTE.get(layout_name, {}))
    geometry = built.geometry
    layers = built.replay.layers
    seq = max(LENGTHS)
    micro_batches = _micro_batches(seq)
    total_pairs = int(sum(_pairs(b).sum() for _, b in micro_batches))
    sched = _Schedule(built, micro_batches, total_pairs)

    def reshard(aligned):
        return [shard_padded(idx, seq, layout, world.coords) for idx in aligned.indices]

    def stage_indices(routes_per_sample):
        out = []
        for mine, batch in micro_batches:
            recs = _records(batch, [routes_per_sample[b] for b in mine], geometry)
            out.append(reshard(align_routes(batch, recs, geometry, layers)))
        return out

    # 1. natural routes: record through the schedule, gather the stages' layers, make
    # layout-free records, reshard back to this stage's layers, replay.
    loss_off, grads_off = sched.run()
    recorded: list[list[torch.Tensor]] = []
    sched.run(forward_only=True, record_into=recorded)
    mine_rec = {layer: [r[j] for r in recorded] for j, layer in enumerate(layers)}
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
    checks["stage_layers"] = {}
    gathered_layers = [None] * world.world_size
    dist.all_gather_object(gathered_layers, (world.coords.pp_rank, list(layers)))
    checks["stage_layers"] = {str(p): ls for p, ls in gathered_layers}

    # 2. forced routes: every router call, forward and recompute, per micro-batch.
    global_routes = [random_routes(100 + b, n - 1, geometry) for b, n in enumerate(LENGTHS)]
    forced = stage_indices(global_routes)
    calls: dict[int, dict[int, list[torch.Tensor]]] = {layer: {} for layer in layers}
    with capture_routing(built.routers) as (maps, _):
        seen = {layer: 0 for layer in layers}
        backwards = [0]

        def attribute(mb):
            for layer in layers:
                calls[layer].setdefault(mb, []).extend(maps[layer][seen[layer] :])
                seen[layer] = len(maps[layer])

        def on_backward():
            attribute(backwards[0])  # 1F1B runs a stage's backwards in forward order
            backwards[0] += 1

        sched.on_forward, sched.on_backward = attribute, on_backward
        try:
            _, grads_forced = sched.run(forced)
        finally:
            sched.on_forward = sched.on_backward = None
    router_grads = all(
        r.router.weight.grad is not None and bool(r.router.weight.grad.abs().sum() > 0)
        for r in built.routers
    )
    checks["router_grads_nonzero"] = _all_ranks(router_grads)
    local = {"pp_rank": world.coords.pp_rank, "calls": calls}
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
    for stage in gathered:
        for layer, per_mb in stage["calls"].items():
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
                got = per_mb.get(m, [])
                if len(got) != calls_per_mb:
                    mismatches[f"pp{stage['pp_rank']}/layer{layer}/mb{m}/calls"] = len(got)
                    continue
                for c, g in enumerate(got):
                    bad = int((g[replayed] != expected[layer][replayed]).any(dim=1).sum())
                    compared += int(replayed.sum())
                    if bad:
                        mismatches[f"pp{stage['pp_rank']}/layer{layer}/mb{m}/call{c}"] = bad
    return {
        "ok": not mismatches and layers_seen == set(geometry.moe_layers),
        "mismatched_rows": mismatches,
        "rows_compared": compared,
        "layers": sorted(layers_seen),
    }
