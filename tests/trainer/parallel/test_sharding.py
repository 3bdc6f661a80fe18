"""Each rank's share of the routes (trainer/sharding/) against megatron-core's own functions.

Oracles: megatron's CP batch split (``get_batch_on_this_cp_rank``) applied to position ids,
its sequence-parallel scatter (``_split_along_first_dim``), its pipeline layer placement
(``get_transformer_layer_offset`` / ``get_num_layers_to_build``); packing and dynamic batching
by round trips. No process group is needed: megatron-core 0.19 asks ``torch.distributed`` for
the size and rank of the CP group it is handed, which the tests answer for one call.
"""

from __future__ import annotations

from types import SimpleNamespace
from unittest import mock

import numpy as np
import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("megatron.core")
from megatron.core.tensor_parallel.mappings import _split_along_first_dim
from megatron.core.transformer.transformer_block import get_num_layers_to_build
from megatron.core.transformer.transformer_layer import get_transformer_layer_offset
from megatron.core.utils import get_batch_on_this_cp_rank

from trainer.sharding import (
    PackPlan,
    Parallelism,
    ParallelismError,
    PipelineSplit,
    RankCoords,
    check_split,
    cp_index,
    dp_shard,
    dynamic_microbatches,
    pad_multiple,
    padded_length,
    shard_padded,
    sp_slice,
    stage_moe_layers,
)

SETTINGS = settings(max_examples=60, deadline=None)


# -- megatron oracles -------------------------------------------------------------------------


def megatron_cp(positions: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """megatron's CP split of a ``[batch, seq]`` tensor (its ``position_ids`` key). megatron
    asks ``torch.distributed`` for the size and rank of the CP group it is given; a stand-in
    group answers them."""
    group = _Group(cp_size, cp_rank)
    with (
        mock.patch.object(dist, "get_world_size", lambda g: g.size()),
        mock.patch.object(dist, "get_rank", lambda g: g.rank()),
    ):
        batch = {"position_ids": positions.clone()}
        return get_batch_on_this_cp_rank(batch, is_hybrid_cp=False, cp_group=group)["position_ids"]


class _Group:
    """What megatron's SP scatter asks of a process group: its size and this rank."""

    def __init__(self, size: int, rank: int):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


def megatron_sp(x: torch.Tensor, tp_size: int, tp_rank: int) -> torch.Tensor:
    """megatron's scatter to the sequence-parallel region (first dimension, ``[seq, b, h]``)."""
    return _split_along_first_dim(x, _Group(tp_size, tp_rank))


def megatron_stage_layers(split: PipelineSplit, pp_rank: int, vp_stage: int | None) -> range:
    config = SimpleNamespace(
        num_layers=split.num_layers,
        pipeline_model_parallel_size=split.pp,
        virtual_pipeline_model_parallel_size=split.vp,
        num_layers_in_first_pipeline_stage=split.first,
        num_layers_in_last_pipeline_stage=split.last,
        account_for_embedding_in_pipeline_split=split.account_for_embedding,
        account_for_loss_in_pipeline_split=split.account_for_loss,
        pipeline_model_parallel_layout=None,
    )
    offset = get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank)
    n = get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank)
    return range(offset, offset + n)


# -- context parallel --------------------------------------------------------------------------


@SETTINGS
@given(
    cp=st.sampled_from([1, 2, 3, 4]),
    tp=st.sampled_from([1, 2]),
    length=st.integers(1, 97),
    batch=st.integers(1, 3),
)
def test_cp_split_matches_megatron_on_a_padded_batch(cp, tp, length, batch):
    multiple = pad_multiple(tp, cp, sequence_parallel=True)
    seq = padded_length(length, multiple)  # odd lengths pad up to the layout's multiple
    positions = torch.arange(seq)[None].repeat(batch, 1) + 1000 * torch.arange(batch)[:, None]
    layout = Parallelism(tp=1, cp=cp)
    for rank in range(cp):
        expected = megatron_cp(positions, cp, rank)  # [batch, seq / cp]
        assert torch.equal(positions[0, torch.from_numpy(cp_index(seq, cp, rank))], expected[0])
        # Megatron's token order: row s * batch + b is token (b, s).
        rows = positions.t().reshape(-1)
        ours = shard_padded(rows, seq, layout, RankCoords(cp_rank=rank))
        assert torch.equal(ours, expected.t().reshape(-1))


def test_cp_refuses_a_sequence_that_is_not_padded():
    with pytest.raises(ParallelismError, match="2 x cp = 4 chunks"):
        cp_index(9, 2, 0)


# -- sequence parallel -------------------------------------------------------------------------


@SETTINGS
@given(
    tp=st.sampled_from([1, 2, 4]),
    cp=st.sampled_from([1, 2]),
    length=st.integers(1, 50),
    batch=st.integers(1, 3),
)
def test_cp_then_sp_matches_megatron(tp, cp, length, batch):
    layout = Parallelism(tp=tp, cp=cp, sequence_parallel=True)
    seq = padded_length(length, layout.multiple)
    positions = torch.arange(seq)[None].repeat(batch, 1) + 1000 * torch.arange(batch)[:, None]
    rows = positions.t().reshape(-1)
    for cp_rank in range(cp):
        # Megatron: CP split of the [b, s] batch, the embedding's [s, b, h], SP scatter.
        local = megatron_cp(positions, cp, cp_rank).t()[:, :, None]
        for tp_rank in range(tp):
            expected = megatron_sp(local, tp, tp_rank).reshape(-1)
            coords = RankCoords(tp_rank=tp_rank, cp_rank=cp_rank)
            assert torch.equal(shard_padded(rows, seq, layout, coords), expected)


def test_sp_slice_refuses_rows_that_do_not_divide():
    assert sp_slice(8, 2, 1) == slice(4, 8)
    with pytest.raises(ParallelismError, match="pad the sequence"):
        sp_slice(9, 2, 0)


# -- pipeline stages ---------------------------------------------------------------------------


def _splits():
    out = []
    for layers in (4, 6, 8, 12, 48):
        for pp in (1, 2, 3, 4):
            for vp in (None, 2, 3):
                out.append(PipelineSplit(layers, pp, vp if pp > 1 else None))
                if pp > 1:
                    out.append(PipelineSplit(layers, pp, vp, account_for_embedding=True))
                    out.append(PipelineSplit(layers, pp, vp, account_for_loss=True))
                    out.append(PipelineSplit(layers, pp, vp, first=1))
                    out.append(PipelineSplit(layers, pp, vp, first=2, last=2))
                    out.append(PipelineSplit(layers, pp, vp, last=layers // pp + 1))
    return out


def _megatron_layers_or_none(split):
    try:
        return {
            (p, v): megatron_stage_layers(split, p, v)
            for p in range(split.pp)
            for v in (range(split.vp) if split.vp else [None])
        }
    except (AssertionError, ZeroDivisionError):  # megatron refuses (or cannot compute) it
        return None


@pytest.mark.parametrize("split", _splits(), ids=str)
def test_stage_layers_match_megatron(split):
    expected = _megatron_layers_or_none(split)
    # Megatron's own checks refuse some splits; where they pass but its stages would not place
    # every layer exactly once, ours refuses too.
    placed = expected and sorted(i for r in expected.values() for i in r)
    if expected is None or placed != list(range(split.num_layers)):
        with pytest.raises(ParallelismError):
            check_split(split, [0])
        return
    for (p, v), layers in expected.items():
        assert split.stage_layers(p, v) == layers, (p, v)


def test_stage_moe_layers_follow_global_layer_numbers():
    # The tiny model: layer 0 dense, MoE layers 1-3.
    split = PipelineSplit(4, pp=2)
    assert stage_moe_layers(split, (1, 2, 3), 0) == (1,)
    assert stage_moe_layers(split, (1, 2, 3), 1) == (2, 3)
    vsplit = PipelineSplit(4, pp=2, vp=2)
    owned = {(p, v): stage_moe_layers(vsplit, (1, 2, 3), p, v) for p in (0, 1) for v in (0, 1)}
    assert owned == {(0, 0): (), (1, 0): (1,), (0, 1): (2,), (1, 1): (3,)}


def test_a_split_that_disagrees_with_the_records_is_refused():
    with pytest.raises(ParallelismError, match="covers layers 0..3"):
        stage_moe_layers(PipelineSplit(4, pp=2), (1, 2, 3, 4), 0)
    with pytest.raises(ParallelismError, match="do not divide over pp=3"):
        stage_moe_layers(PipelineSplit(4, pp=3), (1, 2, 3), 0)
    with pytest.raises(ParallelismError, match="not divisible by vp=2"):
        stage_moe_layers(PipelineSplit(6, pp=2, vp=2), (1, 2, 3), 0)


def test_a_custom_pipeline_layout_is_refused():
    config = SimpleNamespace(pipeline_model_parallel_layout=[["embedding"], ["loss"]])
    with pytest.raises(ParallelismError, match="custom layer layout"):
        PipelineSplit.from_config(config)


# -- packing -----------------------------------------------------------------------------------


def _routes(lengths, layers=3, k=2, experts=8, seed=0):
    rng = np.random.default_rng(seed)
    return [
        np.argsort(rng.random((n - 1, layers, experts)), axis=-1)[..., :k].astype(np.uint8)
        for n in lengths
    ]


@SETTINGS
@given(
    lengths=st.lists(st.integers(1, 30), min_size=1, max_size=6),
    multiple=st.sampled_from([1, 2, 4, 8]),
)
def test_packing_plan_pads_each_sequence_to_the_multiple(lengths, multiple):
    plan = PackPlan.build(lengths, multiple)
    padded_lengths = np.diff(plan.cu_seqlens_padded)
    assert (padded_lengths % multiple == 0).all()
    assert (padded_lengths - plan.lengths < multiple).all()
    assert plan.lengths.tolist() == lengths and plan.total == padded_lengths.sum()


# -- data parallel, micro-batches, dynamic batching --------------------------------------------


def test_dp_shard_and_a_batch_that_does_not_divide():
    assert [list(dp_shard(6, 3, r)) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ParallelismError, match="does not divide over 4 DP ranks"):
        dp_shard(6, 4, 0)
    with pytest.raises(ParallelismError, match="not divisible by tp x cp x pp"):
        Parallelism(tp=4, sequence_parallel=True).dp(6)
    with pytest.raises(ParallelismError, match="sequence_parallel"):
        Parallelism(tp=2).dp(2)
    assert Parallelism(tp=2, ep=2, etp=1, sequence_parallel=True).dp(2) == 1


@SETTINGS
@given(
    lengths=st.lists(st.integers(1, 64), min_size=1, max_size=24),
    budget=st.integers(64, 200),
    multiple=st.sampled_from([1, 2, 4]),
    minimum=st.integers(1, 3),
)
def test_dynamic_batching_permutation_round_trip(lengths, budget, multiple, minimum):
    minimum = min(minimum, len(lengths))
    batches = dynamic_microbatches(lengths, budget, multiple=multiple, min_microbatches=minimum)
    order = _execution_order(batches)
    assert sorted(order.tolist()) == list(range(len(lengths)))  # every sample exactly once
    assert len(batches.groups) >= minimum and all(batches.groups)
    sizes = [padded_length(n, multiple) for n in lengths]
    for group, tokens in zip(batches.groups, batches.tokens, strict=True):
        assert tokens == sum(sizes[i] for i in group) <= budget
    assert list(batches.tokens) == sorted(batches.tokens, reverse=True)
    # Per-sample results computed in execution order come back in the original order.
    results = [f"result of {i}" for i in order]
    assert _in_original_order(batches, results) == [f"result of {i}" for i in range(len(lengths))]
    # Routes follow their tokens through the reordering.
    routes = _routes([n + 1 for n in lengths], layers=1, seed=3)
    reordered = [routes[i] for i in order]
    back = _in_original_order(batches, reordered)
    assert all(a is b for a, b in zip(back, routes, strict=True))


def _execution_order(batches):
    """The original index of the sample at each position of the execution order."""
    return np.fromiter((i for g in batches.groups for i in g), dtype=np.int64)


def _in_original_order(batches, results):
    """Per-sample results given in execution order, back in the original sample order."""
    return [results[p] for p in np.argsort(_execution_order(batches))]


def test_dynamic_batching_balances_and_refuses_an_oversized_sample():
    batches = dynamic_microbatches([50, 10, 40, 30, 20, 50], 100)
    assert sorted(batches.tokens) == [100, 100]
    with pytest.raises(ParallelismError, match="exceeds the micro-batch budget"):
        dynamic_microbatches([10, 101], 100)


# -- the oracles catch a wrong shard -----------------------------------------------------------


def test_a_shard_off_by_one_token_or_one_layer_fails_the_comparison():
    seq, cp = 16, 2
    positions = torch.arange(seq)[None]
    good = torch.from_numpy(cp_index(seq, cp, 1))
    assert torch.equal(positions[0, good], megatron_cp(positions, cp, 1)[0])
    assert not torch.equal(positions[0, good + 1], megatron_cp(positions, cp, 1)[0])
    split = PipelineSplit(8, pp=2, vp=2)
    layers = split.stage_layers(1, 1)
    assert layers == megatron_stage_layers(split, 1, 1)
    shifted = range(layers.start + 1, layers.stop + 1)
    assert shifted != megatron_stage_layers(split, 1, 1)
