"""Router replay through megatron-core's RouterReplay, one process, real model, CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from routereplay.domain.record import MASKED, Geometry
from routereplay.errors import InvalidArgument
from tests.support.replay import recording
from tests.trainer.helpers import (
    capture_routing,
    grads,
    make_record,
    next_token_loss,
    one_hot,
    random_batch,
    random_routes,
    record_natural_routes,
)
from trainer.layout.align import align_routes, routes_from_recorded
from trainer.layout.batch import PaddedBatch
from trainer.model.build import build_model
from trainer.sharding import Parallelism, RankCoords, rank_positions, shard_padded


@pytest.fixture
def built(tiny_model_dir, pg_collection):
    return build_model(tiny_model_dir, routing_replay=True, pg_collection=pg_collection)


def test_installed_replays_are_megatrons_registry_with_their_layer_numbers(built):
    # megatron-core 0.19 numbers each RouterReplay by its router's layer (1-based, global);
    # the instances the builder installs keep that number and are the registry, in layer order.
    replays = [r.replay for r in built.routers]
    assert [r.layer for r in built.routers] == [1, 2, 3]
    assert [p.layer_number for p in replays] == [2, 3, 4]
    assert RouterReplay.global_router_replay_instances == replays


def _train_pass(built, batch, indices=None):
    """One forward + backward from zero grads; replays ``indices`` when given."""
    built.model.zero_grad(set_to_none=True)
    control = built.replay
    with control.step():
        if indices is None:
            loss = next_token_loss(built.model, batch)
            loss.backward()
        else:
            with control.forward(indices):
                loss = next_token_loss(built.model, batch)
            with control.backward():
                loss.backward()
    return loss.detach(), grads(built.model)


def _records(batch, routes, geometry):
    return [
        make_record(batch.sample_ids[b], batch.sample_tokens(b).numpy(), routes[b], geometry)
        for b in range(batch.batch_size)
    ]


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_replaying_natural_routes_is_bit_identical_to_disabled(built, padding_side):
    batch = random_batch(1, [9, 4, 12], padding_side)
    loss_off, grads_off = _train_pass(built, batch)
    recorded: list[list[torch.Tensor]] = []
    with torch.no_grad(), built.replay.step(), recording(built.replay, recorded):
        next_token_loss(built.model, batch)
    # Through the record form and back: final tokens and padding are MASKED (native) rows.
    routes = routes_from_recorded(batch, recorded[0], built.geometry)
    aligned = align_routes(
        batch, _records(batch, routes, built.geometry), built.geometry, built.replay.layers
    )
    assert not aligned.replayed.all()
    loss_on, grads_on = _train_pass(built, batch, aligned.indices)
    assert torch.equal(loss_on, loss_off)
    assert grads_on.keys() == grads_off.keys()
    for name, g in grads_off.items():
        assert torch.equal(grads_on[name], g), name


def test_forced_routes_are_followed_and_masked_rows_route_natively(built):
    batch = random_batch(2, [10, 6, 8], "right")
    geometry = built.geometry
    routes = [random_routes(100 + b, int(n) - 1, geometry) for b, n in enumerate(batch.lengths)]
    aligned = align_routes(batch, _records(batch, routes, geometry), geometry, built.replay.layers)
    built.model.zero_grad(set_to_none=True)
    with built.replay.step(), capture_routing(built.routers) as (maps, logits):
        with built.replay.forward(aligned.indices):
            loss = next_token_loss(built.model, batch)
        with built.replay.backward():
            loss.backward()
    replayed = aligned.replayed.reshape(-1)
    for j, layer in enumerate(built.replay.layers):
        routing = maps[layer][0]
        forced = one_hot(aligned.indices[j][replayed].long(), geometry.num_experts)
        assert torch.equal(routing[replayed], forced), f"layer {layer}"
        natural = one_hot(
            logits[layer][0].topk(geometry.topk, dim=-1).indices, geometry.num_experts
        )
        assert torch.equal(routing[~replayed], natural[~replayed]), f"layer {layer}"
        # Replay changed the choice somewhere (random routes are not the natural ones).
        assert not torch.equal(routing[replayed], natural[replayed])
    for r in built.routers:
        grad = r.router.weight.grad
        assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


def _expected_indices(batch, routes, layer_columns, k):
    """Independent alignment: token (b, column) is megatron row column * batch + b."""
    out = {j: np.full((batch.seq_len * batch.batch_size, k), MASKED) for j in layer_columns}
    for b in range(batch.batch_size):
        start = int(batch.starts[b])
        for i in range(routes[b].shape[0]):  # row i = token i as input; no row for the last
            for j in layer_columns:
                out[j][(start + i) * batch.batch_size + b] = routes[b][i, j]
    return out


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_alignment_matches_an_independent_computation(built, padding_side):
    geometry = built.geometry
    batch = random_batch(3, [7, 3, 9, 9], padding_side)
    routes = [random_routes(7 + b, int(n) - 1, geometry) for b, n in enumerate(batch.lengths)]
    aligned = align_routes(batch, _records(batch, routes, geometry), geometry, built.replay.layers)
    expected = _expected_indices(batch, routes, range(geometry.num_moe_layers), geometry.topk)
    for j in range(geometry.num_moe_layers):
        assert aligned.indices[j].dtype == torch.int16  # replay_dtype of the tiny model's experts
        np.testing.assert_array_equal(aligned.indices[j].numpy(), expected[j])
    rows_with_route = (batch.lengths - 1).sum()
    assert int(aligned.replayed.sum()) == int(rows_with_route)
    # A subset of routers (a pipeline stage) gets its own layers' columns.
    stage = align_routes(
        batch, _records(batch, routes, geometry), geometry, geometry.moe_layers[1:]
    )
    for j, layer in enumerate(geometry.moe_layers[1:]):
        np.testing.assert_array_equal(stage.indices[j].numpy(), expected[layer - 1])


@pytest.mark.parametrize(
    "layout",
    [
        Parallelism(tp=2, sequence_parallel=True),
        Parallelism(cp=2),
        Parallelism(tp=2, cp=2, sequence_parallel=True),
    ],
    ids=["tp2sp", "cp2", "tp2sp_cp2"],
)
@pytest.mark.parametrize("form", ["right", "left", "packed"])
def test_aligning_a_ranks_positions_equals_cutting_the_whole_alignment(layout, form):
    """A rank aligns only the rows it keeps (its CP chunks, its SP share): the same ids as
    aligning every row and cutting them with ``shard_padded``, and the same replayed rows."""
    geometry = Geometry((1, 2, 3), 2, 8, "m")
    lengths = [9, 4, 13]
    tokens = [np.arange(2, 2 + n) for n in lengths]
    ids = [f"p{i}" for i in range(len(lengths))]
    if form == "packed":
        batch = PaddedBatch.packed(ids, tokens, multiple=layout.multiple)
    else:
        batch = PaddedBatch.from_samples(ids, tokens, padding_side=form, max_length=16)
    routes = [random_routes(20 + b, n - 1, geometry) for b, n in enumerate(lengths)]
    records = _records(batch, routes, geometry)
    whole = align_routes(batch, records, geometry, geometry.moe_layers)
    held = 0
    for tp_rank, cp_rank in np.ndindex(layout.tp, layout.cp):
        coords = RankCoords(tp_rank=int(tp_rank), cp_rank=int(cp_rank))
        positions = rank_positions(batch.seq_len, layout, coords)
        mine = align_routes(batch, records, geometry, geometry.moe_layers, positions=positions)
        assert torch.equal(mine.replayed, whole.replayed)
        for got, full in zip(mine.indices, whole.indices, strict=True):
            want = shard_padded(full, batch.seq_len, layout, coords)
            assert torch.equal(got, want), (coords, form)
        held += int((mine.indices[0][:, 0] != MASKED).sum())
    assert held == int(whole.replayed.sum()) == sum(lengths) - 3  # each row on one rank


def test_uint16_expert_ids_survive_alignment_and_resharding():
    """Ids above 32767 (and 65535) stay themselves: never the MASKED marker, never negative."""
    geometry = Geometry((0,), 2, 65536, "m")
    ids = np.array([[[65535, 40000]], [[1, 32768]]], dtype=np.uint16)  # [2 rows, 1 layer, k 2]
    batch = PaddedBatch.packed(["s"], [np.array([5, 6, 7])], multiple=2)
    record = make_record("s", np.array([5, 6, 7]), ids, geometry)
    aligned = align_routes(batch, [record], geometry, [0])
    np.testing.assert_array_equal(aligned.indices[0][:2].numpy(), ids[:, 0].astype(np.int64))
    assert (aligned.indices[0][2:] == MASKED).all()
    local = shard_padded(
        aligned.indices[0], batch.seq_len, Parallelism(tp=2, sequence_parallel=True), RankCoords()
    )
    np.testing.assert_array_equal(local.numpy(), ids[:, 0].astype(np.int64))


def test_missing_record_fails_or_routes_natively(built):
    geometry = built.geometry
    batch = random_batch(4, [5, 6], "right")
    routes = [random_routes(b, int(n) - 1, geometry) for b, n in enumerate(batch.lengths)]
    records = _records(batch, routes, geometry)
    records[1] = None
    with pytest.raises(InvalidArgument, match="no record for sample"):
        align_routes(batch, records, geometry, built.replay.layers)
    aligned = align_routes(batch, records, geometry, built.replay.layers, missing="native")
    assert aligned.missing == [batch.sample_ids[1]]
    assert not aligned.replayed[:, 1].any() and aligned.replayed[:4, 0].all()


def test_bad_records_are_refused_naming_both_sides(built):
    geometry = built.geometry
    batch = random_batch(5, [5], "right")
    routes = [random_routes(0, 4, geometry)]
    other = Geometry((0, 1, 2), geometry.topk, geometry.num_experts, "other")
    with pytest.raises(InvalidArgument, match=r"moe_layers=\[0, 1, 2\].*moe_layers=\[1, 2, 3\]"):
        align_routes(batch, _records(batch, routes, other), geometry, built.replay.layers)
    shifted = _records(batch, routes, geometry)
    shifted[0].token_ids = shifted[0].token_ids.copy()
    shifted[0].token_ids[2] += 1
    with pytest.raises(InvalidArgument, match="differ from the batch's at position 2"):
        align_routes(batch, shifted, geometry, built.replay.layers)
    with pytest.raises(InvalidArgument, match="routed by model"):
        align_routes(
            batch, _records(batch, routes, geometry), geometry, built.replay.layers, model_id="x"
        )


def test_indices_are_cleared_every_step(built):
    batch = random_batch(6, [6, 6], "right")
    geometry = built.geometry
    routes = [random_routes(b, 5, geometry) for b in range(2)]
    aligned = align_routes(batch, _records(batch, routes, geometry), geometry, built.replay.layers)
    for _ in range(3):
        _train_pass(built, batch, aligned.indices)
    for r in built.routers:
        assert r.replay.replay_backward_list == [] and r.replay.target_topk_idx is None
        assert r.replay.router_replay_action is None


def _two_micro_batches_in_flight(built, micro_batches, leave_forward_on=False):
    """Forward both micro-batches, then backward both in forward order (what a pipeline
    schedule does with 2 in flight); returns the accumulated gradients."""
    control = built.replay
    built.model.zero_grad(set_to_none=True)
    with control.step():
        losses = []
        for batch, indices in micro_batches:
            with control.forward(indices):
                losses.append(next_token_loss(built.model, batch))
        for loss in losses:
            if leave_forward_on:  # the trap: REPLAY_FORWARD still on while recompute runs
                for r in built.routers:
                    r.replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
                loss.backward()
            else:
                with control.backward():
                    loss.backward()
        left = [len(r.replay.replay_backward_list) for r in built.routers]
    return grads(built.model), left


def test_recompute_with_two_micro_batches_in_flight(tiny_model_dir, pg_collection):
    recompute = dict(
        recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
    )
    plain = build_model(tiny_model_dir, routing_replay=True, pg_collection=pg_collection)
    micro_batches = []
    for seed in (11, 12):
        batch = random_batch(seed, [7, 5], "right")
        routes = [
            random_routes(seed * 10 + b, int(n) - 1, plain.geometry)
            for b, n in enumerate(batch.lengths)
        ]
        records = _records(batch, routes, plain.geometry)
        micro_batches.append(
            (batch, align_routes(batch, records, plain.geometry, plain.replay.layers).indices)
        )
    reference, _ = _two_micro_batches_in_flight(plain, micro_batches)
    recomputed = build_model(
        tiny_model_dir, routing_replay=True, pg_collection=pg_collection, **recompute
    )
    with capture_routing(recomputed.routers) as (maps, _):
        with_backward, left = _two_micro_batches_in_flight(recomputed, micro_batches)
    # Each router ran twice per micro-batch (forward, then recompute in backward), and the
    # recomputes drained the REPLAY_BACKWARD FIFO.
    assert all(len(calls) == 4 for calls in maps.values()) and left == [0, 0, 0]
    for name, g in reference.items():
        assert torch.equal(with_backward[name], g), name
    # Leaving REPLAY_FORWARD on recomputes micro-batch 1 with micro-batch 2's routes: the
    # gradients are silently wrong (same shapes, no error).
    trap, _ = _two_micro_batches_in_flight(recomputed, micro_batches, leave_forward_on=True)
    assert any(not torch.equal(trap[name], g) for name, g in reference.items())


def test_r2_update_passes_after_an_optimizer_step_use_the_recorded_routes(built):
    micro_batches = [random_batch(21, [8, 6], "left"), random_batch(22, [5, 9], "left")]
    _, records = record_natural_routes(built, micro_batches, next_token_loss)
    by_id = {r.sample_id: r for r in records}
    for r in records:
        r.validate()
    # A large step on the routers only, so natural routing really moves.
    optimizer = torch.optim.SGD([r.router.weight for r in built.routers], lr=50.0)
    changed = False
    for batch in micro_batches:
        aligned = align_routes(
            batch, [by_id[s] for s in batch.sample_ids], built.geometry, built.replay.layers
        )
        built.model.zero_grad(set_to_none=True)
        with built.replay.step(), capture_routing(built.routers) as (maps, logits):
            with built.replay.forward(aligned.indices):
                loss = next_token_loss(built.model, batch)
            with built.replay.backward():
                loss.backward()
        optimizer.step()
        replayed = aligned.replayed.reshape(-1)
        for j, layer in enumerate(built.replay.layers):
            recorded = one_hot(aligned.indices[j][replayed].long(), built.geometry.num_experts)
            assert torch.equal(maps[layer][0][replayed], recorded), f"layer {layer}"
            natural = logits[layer][0].topk(built.geometry.topk, dim=-1).indices
            changed |= not torch.equal(
                one_hot(natural, built.geometry.num_experts)[replayed], recorded
            )
    assert changed, "the optimizer step did not move natural routing; the test proves nothing"
