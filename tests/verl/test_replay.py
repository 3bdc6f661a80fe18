"""The integration against verl 0.9.1's own code, on the trainer's megatron model (CPU, gloo).

Records come from the transformers rollout (``routereplay/dev/hf_rollout.py``), reach the route
cache (real server, real redis-server) through the rollout seam as verl ``TokenOutput``s, and
come back through the trainer seam; verl's ``align_r3_router_replay_data``,
``build_r3_replay_mask`` and ``set_router_replay_data`` then set the routers' targets, and a
forward hook on every router checks what it chose, row by row.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from routereplay.dev.hf_rollout import random_prompts, rollout_records
from routereplay.errors import InvalidArgument, NotFound
from routereplay.rpc.client import RouteCacheClient
from tests.verl.cpu import needs_verl
from tests.verl.helpers import (
    check_rows,
    engine_capture,
    forward_packed,
    geometry_of,
    nested,
    replay_r3,
    token_output,
    verl_model,
)
from trainer.data.source import CacheSource
from trainer.layout.batch import PaddedBatch
from verl_integration.contract import ID_FIELD
from verl_integration.fetch import RouteFetcher, native_where_missing
from verl_integration.rollout import TurnWriter, without_routes

needs_verl()

PROMPT_LENGTHS = [5, 8]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def rollout(tiny_model_dir, route_cache):
    """4 samples (2 prompts x 2), each written through the rollout seam as one verl call."""
    prompts = random_prompts(2, PROMPT_LENGTHS, 512, seed=5)
    records = rollout_records(
        tiny_model_dir, prompts, group_size=2, new_tokens=NEW_TOKENS, seed=1, prefix="verl1"
    )
    geometry = geometry_of(tiny_model_dir)
    with RouteCacheClient(route_cache) as client:
        writer = TurnWriter(client, geometry)
        for record in records:
            prompt_len = record.turns[0].generated_start
            output = token_output(record, prompt_len, policy_version=3)
            writer.write(record.sample_id, record.token_ids[:prompt_len].tolist(), output)
            shipped = without_routes(output, record.sample_id)
            assert (
                shipped.routed_experts is None
                and shipped.extra_fields[ID_FIELD] == record.sample_id
            )
    return records


def _response_mask(records) -> torch.Tensor:
    """verl's padded ``response_mask`` ``[bs, response_length]``: 1 on generated tokens."""
    return torch.ones(len(records), NEW_TOKENS, dtype=torch.int64)


def _expected(records, geometry):
    def expected(b, p, layer):
        r = records[b]
        if p >= r.num_rows:
            return None
        return r.routes[p, geometry.record.moe_layers.index(layer)]

    return expected


def test_rollout_seam_stores_each_samples_moe_rows(rollout, route_cache, tiny_model_dir):
    with RouteCacheClient(route_cache) as client:
        for record in rollout:
            stored = client.read(record.sample_id)
            assert np.array_equal(stored.token_ids, record.token_ids)
            assert np.array_equal(stored.routes, record.routes)
            assert [t.policy_version for t in stored.turns] == [3]
            assert stored.turns[0].generated_start == record.turns[0].generated_start


def test_fetched_field_equals_verls_own_on_every_column_verl_reads(
    rollout, route_cache, tiny_model_dir
):
    """verl's agent loop aligns the rollout's tensor to the sample (``AgentLoopOutput.as_dict``);
    the fetched field equals it on every MoE column (dense columns: zero here, never read)."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    geometry = geometry_of(tiny_model_dir)
    fetcher = RouteFetcher(CacheSource(route_cache), geometry)
    ids = [r.sample_id for r in rollout]
    input_ids = nested([torch.from_numpy(r.token_ids.astype(np.int64)) for r in rollout])
    routes = fetcher.routes(ids, input_ids).routed_experts
    moe = list(geometry.record.moe_layers)
    for record, mine in zip(rollout, routes.unbind(), strict=True):
        prompt_len = record.turns[0].generated_start
        theirs = AgentLoopOutput(
            prompt_ids=record.token_ids[:prompt_len].tolist(),
            response_ids=record.token_ids[prompt_len:].tolist(),
            response_mask=[1] * (record.num_tokens - prompt_len),
            routed_experts=engine_capture(record, geometry.num_hidden_layers),
            metrics=AgentLoopMetrics(),
        ).as_dict()["routed_experts"]
        assert mine.dtype == theirs.dtype == torch.int16
        assert mine.shape == theirs.shape
        assert torch.equal(mine[:, moe], theirs[:, moe])
        assert not mine[:, [i for i in range(geometry.num_hidden_layers) if i not in moe]].any()


def test_nested_layout_every_router_follows_the_records(
    rollout, route_cache, tiny_model_dir, pg_collection
):
    geometry = geometry_of(tiny_model_dir)
    built = verl_model(tiny_model_dir, pg_collection)
    ids = [r.sample_id for r in rollout]
    tokens = [torch.from_numpy(r.token_ids.astype(np.int64)) for r in rollout]
    routes = RouteFetcher(CacheSource(route_cache), geometry).routes(ids, nested(tokens))
    replay_r3(
        built.model,
        routes.routed_experts,
        nested(tokens),
        _response_mask(rollout),
        built.model.config,
    )
    batch = PaddedBatch.packed(ids, [t.numpy() for t in tokens])
    maps, logits = forward_packed(built, batch)
    replayed, natural, bad = check_rows(
        maps,
        logits,
        batch,
        _expected(rollout, geometry),
        native=lambda b, p: p == rollout[b].num_tokens - 1,
        topk=geometry.record.topk,
    )
    assert not bad, bad[:10]
    assert sorted(maps) == [1, 2, 3]
    # Every token but each sample's last, on each of the 3 MoE layers; the last ones natively.
    assert replayed == 3 * sum(r.num_rows for r in rollout)
    assert natural == 3 * len(rollout)


def test_padded_layout_every_router_follows_the_records(
    rollout, route_cache, tiny_model_dir, pg_collection
):
    """verl's padded (BSHD) call: ``set_router_replay_data(routes [bs, seq, L, k],
    attention_mask)``, prompts left-padded and responses right-padded as verl's agent loop
    lays them out."""
    from verl.utils.megatron.router_replay_patch import RouterReplayAction
    from verl.utils.megatron.router_replay_utils import (
        set_model_router_replay_action,
        set_router_replay_data,
    )

    geometry = geometry_of(tiny_model_dir)
    built = verl_model(tiny_model_dir, pg_collection)
    ids = [r.sample_id for r in rollout]
    prompt_width, response_width = max(PROMPT_LENGTHS) + 1, NEW_TOKENS + 2
    input_ids = torch.zeros(len(rollout), prompt_width + response_width, dtype=torch.int64)
    attention_mask = torch.zeros_like(input_ids, dtype=torch.bool)
    for b, r in enumerate(rollout):
        prompt_len = r.turns[0].generated_start
        span = slice(prompt_width - prompt_len, prompt_width + r.num_tokens - prompt_len)
        input_ids[b, span] = torch.from_numpy(r.token_ids.astype(np.int64))
        attention_mask[b, span] = True
    routes = RouteFetcher(CacheSource(route_cache), geometry).routes(ids, input_ids, attention_mask)
    assert routes.routed_experts.shape == (*input_ids.shape, geometry.num_hidden_layers, 2)
    set_model_router_replay_action(built.model, RouterReplayAction.REPLAY_FORWARD)
    set_router_replay_data(
        routes.routed_experts, attention_mask, built.model.config, 0, model=built.model
    )
    batch = PaddedBatch.packed(ids, [r.token_ids for r in rollout])
    maps, logits = forward_packed(built, batch)
    replayed, _, bad = check_rows(
        maps, logits, batch, _expected(rollout, geometry), native=lambda b, p: False, topk=2
    )
    assert not bad, bad[:10]
    assert replayed == 3 * sum(r.num_rows for r in rollout)


def test_missing_record_is_an_error_naming_it_or_native_by_setting(
    rollout, route_cache, tiny_model_dir, pg_collection
):
    geometry = geometry_of(tiny_model_dir)
    ids = [rollout[0].sample_id, "verl-never-written", rollout[2].sample_id]
    kept = [rollout[0], None, rollout[2]]
    tokens = [
        torch.from_numpy(rollout[0].token_ids.astype(np.int64)),
        torch.arange(2, 13, dtype=torch.int64),
        torch.from_numpy(rollout[2].token_ids.astype(np.int64)),
    ]
    with pytest.raises(NotFound, match="verl-never-written"):
        RouteFetcher(CacheSource(route_cache), geometry).routes(ids, nested(tokens))

    routes = RouteFetcher(CacheSource(route_cache), geometry, missing="native").routes(
        ids, nested(tokens)
    )
    assert routes.present.tolist() == [True, False, True]
    built = verl_model(tiny_model_dir, pg_collection)
    replay_r3(
        built.model,
        routes.routed_experts,
        nested(tokens),
        torch.ones(3, NEW_TOKENS),
        built.model.config,
        mask_hook=lambda m: native_where_missing(m, routes.routed),
    )
    batch = PaddedBatch.packed(ids, [t.numpy() for t in tokens])
    maps, logits = forward_packed(built, batch)

    def expected(b, p, layer):
        return None if kept[b] is None else _expected(kept, geometry)(b, p, layer)

    replayed, natural, bad = check_rows(
        maps,
        logits,
        batch,
        expected,
        topk=2,
        native=lambda b, p: kept[b] is None or p == len(tokens[b]) - 1,
    )
    assert not bad, bad[:10]
    assert natural == 3 * (len(tokens[1]) + 2)


def test_records_of_another_model_are_refused_naming_the_sample(
    rollout, route_cache, tiny_model_dir
):
    geometry = geometry_of(tiny_model_dir)
    other = dataclasses.replace(geometry.record, num_experts=16, model_id="other")
    fetcher = RouteFetcher(CacheSource(route_cache), dataclasses.replace(geometry, record=other))
    sample = rollout[1]
    with pytest.raises(InvalidArgument, match=f"{sample.sample_id}.*num_experts=8.*num_experts=16"):
        fetcher.routes(
            [sample.sample_id], nested([torch.from_numpy(sample.token_ids.astype(np.int64))])
        )
    # A rollout of another model (its capture has 6 layers) is refused before anything is written.
    capture = engine_capture(sample, 6)
    output = token_output(sample, 5).model_copy(update={"routed_experts": capture})
    with RouteCacheClient(route_cache) as client:
        with pytest.raises(InvalidArgument, match="verl-other.*num_hidden_layers=4"):
            TurnWriter(client, geometry).write("verl-other", sample.token_ids[:5].tolist(), output)
        with pytest.raises(NotFound):
            client.stat("verl-other")


def test_tokens_past_the_record_route_natively_with_the_mask_hook(
    rollout, route_cache, tiny_model_dir, pg_collection
):
    """A batch sample longer than its record (a tool's answer after the last generation: no
    call ran those tokens). verl's own mask replays every row but the last, so its zero rows
    would be replayed as expert 0, k times; ``native_where_missing`` routes them natively."""
    geometry = geometry_of(tiny_model_dir)
    record = rollout[3]
    tokens = torch.cat(
        [torch.from_numpy(record.token_ids.astype(np.int64)), torch.tensor([301, 302, 303])]
    )
    routes = RouteFetcher(CacheSource(route_cache), geometry).routes(
        [record.sample_id], nested([tokens])
    )
    assert routes.routed.values().tolist() == [True] * record.num_rows + [False] * 4
    batch = PaddedBatch.packed([record.sample_id], [tokens.numpy()])
    past = range(record.num_rows, len(tokens) - 1)  # replayed by verl's mask, no route
    for hook in (None, lambda m: native_where_missing(m, routes.routed)):
        built = verl_model(tiny_model_dir, pg_collection)
        replay_r3(
            built.model,
            routes.routed_experts,
            nested([tokens]),
            torch.ones(1, 4),
            built.model.config,
            mask_hook=hook,
        )
        maps, logits = forward_packed(built, batch)
        expert0 = {
            layer: [bool(m[p, 0]) and int(m[p].sum()) == 1 for p in past]
            for layer, m in maps.items()
        }
        if hook is None:
            assert all(all(v) for v in expert0.values()), expert0
            continue
        replayed, natural, bad = check_rows(
            maps,
            logits,
            batch,
            _expected([record], geometry),
            topk=2,
            native=lambda b, p: p >= record.num_rows,
        )
        assert not bad, bad[:10]
        assert (replayed, natural) == (3 * record.num_rows, 3 * 4)


def test_tokens_differing_after_the_first_turn_route_natively_from_there(
    rollout, route_cache, tiny_model_dir
):
    """A two-turn record; the batch's history lacks the first turn's last token (verl's GLM
    token builder drops a stop token at the assistant/tool junction). The rows before the first
    difference saw the recorded prefix and are replayed; the rest route natively, counted in
    ``Routes.diverged``. A difference inside the first turn is another sample's record."""
    from verl.workers.rollout.replica import TokenOutput

    geometry = geometry_of(tiny_model_dir)
    first, sample = rollout[0], "verl-diverged"
    start = first.turns[0].generated_start
    history = first.token_ids.tolist() + [301, 302]
    generated = [55, 66, 77]
    rng = np.random.default_rng(0)
    rows = len(history) + len(generated) - 1
    capture = np.stack(
        [
            np.stack([rng.permutation(8)[:2] for _ in range(geometry.num_hidden_layers)])
            for _ in range(rows)
        ]
    ).astype(np.int32)
    second = TokenOutput(token_ids=generated, routed_experts=capture, extra_fields={})
    with RouteCacheClient(route_cache) as client:
        writer = TurnWriter(client, geometry)
        writer.write(sample, first.token_ids[:start].tolist(), token_output(first, start))
        writer.write(sample, history, second)
        stored = client.read(sample)
    assert [(t.token_start, t.token_end) for t in stored.turns] == [
        (0, first.num_tokens),
        (first.num_tokens, stored.num_tokens),
    ]
    fetcher = RouteFetcher(CacheSource(route_cache), geometry)
    moe = list(geometry.record.moe_layers)
    junction = first.num_tokens - 1  # the first turn's last token, dropped by the batch
    tokens = torch.tensor(
        first.token_ids[:junction].tolist() + [301, 302] + generated, dtype=torch.int64
    )
    routes = fetcher.routes([sample], nested([tokens]))
    assert routes.routed.values().tolist() == [True] * junction + [False] * (len(tokens) - junction)
    assert routes.diverged.tolist() == [min(stored.num_rows, len(tokens)) - junction]
    field = routes.routed_experts.values()
    assert np.array_equal(field[:junction, moe].numpy(), stored.routes[:junction])
    assert not field[junction:].any()
    # A difference inside the second turn: replayed up to it.
    later = torch.from_numpy(stored.token_ids.astype(np.int64)).clone()
    later[first.num_tokens + 1] = 9
    routes = fetcher.routes([sample], nested([later]))
    assert routes.routed.values().sum() == first.num_tokens + 1
    # Inside the first turn: refused, naming the sample.
    other = torch.from_numpy(stored.token_ids.astype(np.int64)).clone()
    other[2] += 1
    with pytest.raises(InvalidArgument, match=f"{sample}.*position 2, inside its first turn"):
        fetcher.routes([sample], nested([other]))
