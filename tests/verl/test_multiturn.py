"""A three-turn sample whose turns three policy versions generated (verl #6054).

Each ``generate()`` call of an agent loop re-runs the whole history under the weights loaded
now, so its ``routed_experts`` hold the current policy's routes for the earlier turns too. verl's
tool agent loop keeps the last call's tensor (``agent_data.routed_experts =
output.routed_experts``), so the first turns are replayed with routes their policy never chose.
Through the integration every call appends only its new rows: each turn keeps its own.

The three policies are the tiny model with three seeds (weights far apart: their routes differ
on most tokens); the calls are the transformers rollout of each, on the growing history.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from routereplay.dev.tiny_model import build_tiny_model
from routereplay.rpc.client import RouteCacheClient
from tests.verl.cpu import needs_verl
from tests.verl.helpers import (
    check_rows,
    engine_capture,
    forward_packed,
    geometry_of,
    nested,
    replay_r3,
    verl_model,
    write_turns,
)
from trainer.data.source import CacheSource
from trainer.layout.batch import PaddedBatch
from verl_integration.fetch import RouteFetcher
from verl_integration.rollout import TurnWriter

needs_verl()

SAMPLE = "verl-three-turns"
PROMPT = [17, 230, 41, 99, 5]
TOOL_TOKENS = [[301, 302, 303], [404, 405]]  # what the environment answers after turns 1 and 2
NEW_TOKENS = 4


@pytest.fixture(scope="module")
def calls(tiny_model_dir, tmp_path_factory, route_cache):
    """The three calls' records (each: the history so far plus 4 generated tokens, routes of
    every row by that call's policy), each written through the rollout seam."""
    policies = [tiny_model_dir] + [
        build_tiny_model(tmp_path_factory.mktemp(f"policy{v}"), seed=v) for v in (1, 2)
    ]
    geometry = geometry_of(tiny_model_dir)
    with RouteCacheClient(route_cache) as client:
        return write_turns(
            TurnWriter(client, geometry), SAMPLE, policies, PROMPT, TOOL_TOKENS, NEW_TOKENS
        )


def _per_turn(calls) -> np.ndarray:
    """Routes of each row as generated: row i from the first call that ran token i."""
    rows = []
    for i in range(calls[-1].num_rows):
        call = next(c for c in calls if i < c.num_rows)
        rows.append(call.routes[i])
    return np.stack(rows)


def test_each_turn_keeps_its_policys_routes(calls, route_cache):
    with RouteCacheClient(route_cache) as client:
        stored = client.read(SAMPLE)
    assert np.array_equal(stored.token_ids, calls[-1].token_ids)
    assert [t.policy_version for t in stored.turns] == [0, 1, 2]
    assert [(t.token_start, t.token_end, t.generated_start) for t in stored.turns] == [
        (0, 9, 5),
        (9, 16, 12),
        (16, 22, 18),
    ]
    assert np.array_equal(stored.routes, _per_turn(calls))


def test_replay_follows_each_turns_routes_where_verls_overwrite_does_not(
    calls, route_cache, tiny_model_dir, pg_collection
):
    """Both tensors through verl's own align, mask and ``set_router_replay_data``: the
    integration's makes every router follow the routes each turn was generated with; verl's
    (the last call's, aligned by its own ``AgentLoopOutput.as_dict``) replays the third policy's
    routes on the first two turns' tokens."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    geometry = geometry_of(tiny_model_dir)
    last = calls[-1]
    tokens = torch.from_numpy(last.token_ids.astype(np.int64))
    per_turn = _per_turn(calls)
    mine = RouteFetcher(CacheSource(route_cache), geometry).routes([SAMPLE], nested([tokens]))
    theirs = AgentLoopOutput(
        prompt_ids=PROMPT,
        response_ids=last.token_ids[len(PROMPT) :].tolist(),
        response_mask=[1] * (last.num_tokens - len(PROMPT)),
        routed_experts=engine_capture(last, geometry.num_hidden_layers),
        metrics=AgentLoopMetrics(),
    ).as_dict()["routed_experts"]
    batch = PaddedBatch.packed([SAMPLE], [last.token_ids])
    moe = geometry.record.moe_layers
    followed = {}
    for name, field, routes in (
        ("integration", mine.routed_experts, per_turn),
        ("verl", nested([theirs]), last.routes),
    ):
        built = verl_model(tiny_model_dir, pg_collection)
        replay_r3(
            built.model, field, nested([tokens]), torch.ones(1, NEW_TOKENS), built.model.config
        )
        maps, logits = forward_packed(built, batch)
        replayed, _, bad = check_rows(
            maps,
            logits,
            batch,
            lambda b, p, layer, routes=routes: (
                routes[p, moe.index(layer)] if p < last.num_rows else None
            ),
            native=lambda b, p: p == last.num_rows,
            topk=geometry.record.topk,
        )
        assert not bad, (name, bad[:10])
        assert replayed == len(moe) * last.num_rows
        followed[name] = routes
    # The rows of turns 1 and 2 (tokens 0-14 as inputs) where verl's overwrite replays experts
    # their policy did not choose: the case verl #6054 loses.
    earlier = slice(0, calls[1].num_rows)
    lost = (np.sort(followed["verl"][earlier], -1) != np.sort(per_turn[earlier], -1)).any(-1)
    assert lost.sum() > 0.3 * lost.size, lost.sum()
    # The last turn's own rows agree: both hold the third policy's.
    tail = slice(calls[1].num_rows, last.num_rows)
    assert np.array_equal(followed["verl"][tail], per_turn[tail])
