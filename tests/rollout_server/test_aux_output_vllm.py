"""vLLM 0.33.0's and 0.34.0's own AuxOutput bookkeeping, played through engine steps, read by the
rollout server and stored in a real route cache, every stored row checked.

What runs unchanged, from each release's wheel (downloaded by the test set-up into a cache
outside the repository, ``vllm_wheels``; a failed download fails the test): the scheduler
connector (``AuxOutputSchedulerConnector``: emit starts, block hashes, prefix-hit caps, terminal
events), the worker connector (``AuxOutputWorkerConnector``: capture cursors, rejected-draft
trimming, publication, materialising prompt rows from the store), the row buffer
(``RoutedExpertsBuffer``) and the block store (``BackgroundBlockObjectStore`` over
``BlockObjectStore``, its writer thread included). On the rollout server's side everything
from ``VLLMEngine.generate`` (the reader and its validation) through ``Rollout`` (the record or
turn append, the policy version) and ``RecordWriter`` to the route cache (real gRPC, a real
``redis-server``) is the project's own code.

What is stood in for, and why (``aux_output_engine``, ``vllm_wheels``):
- the capture kernel and its GPU buffer (``RoutedExpertsCapturer``): it needs a GPU and a
  model. The stand-in forward pass writes a routing that is a pure function of the policy
  version and the tokens so far (``route_rows``); the device-to-host copy is a CPU tensor's.
- the KV cache manager's prefix cache and its hit lookup: vLLM's is GPU memory management;
  the stand-in caches hashed full blocks and caps a hit with the connector's own
  ``max_cache_hit``, as vLLM's scheduler does.
- the scheduler and model runner around the connectors (admission, chunked prefill, preemption,
  drafts, acceptance): vLLM's need the whole engine. The stand-in calls the connectors in
  vLLM's order, one batch in flight (vLLM's async scheduling, two in flight, is not played).
- ``AsyncLLM`` and its output processor: the rollout server's ``VLLMEngine`` reads a final
  output whose ``routed_experts`` is the join of the chunks the connector emitted.
- the few modules of vLLM those files import (logging, a type name, one tensor-parallel rank,
  the KV helpers with vLLM's default settings): the rest of the wheel needs CUDA to import.

The oracle is independent of vLLM's bookkeeping: every stored row is recomputed from the
record's own tokens and turn versions with ``route_rows``.
"""

from __future__ import annotations

import asyncio
import uuid

import numpy as np
import pytest

from rollout_server.engine import CHECKED_V2_VLLM, VLLMEngine, aux_output_store_grows
from rollout_server.rollout import Rollout, RolloutLimits
from rollout_server.writer import RecordWriter
from routereplay.domain.rollout import SampleDone, SamplingOptions
from routereplay.rpc.client import AsyncRouteCacheClient
from tests.rollout_server.aux_output_engine import (
    BLOCK,
    StandInAsyncLLM,
    StepPlayer,
    route_rows,
)
from tests.rollout_server.vllm_wheels import load_aux_output

pytest.importorskip("vllm")  # VLLMEngine's reader builds vLLM's SamplingParams

VERSIONS = [pin.split("==")[1] for pin in CHECKED_V2_VLLM]
_loaded: dict[str, object] = {}


def aux_output(version: str):
    """The wheel's AuxOutput modules, loaded once per session; a failed download fails."""
    if version not in _loaded:
        try:
            _loaded[version] = load_aux_output(version)
        except RuntimeError as exc:
            pytest.fail(f"vLLM {version}'s wheel is needed and could not be had: {exc}")
    return _loaded[version]


def prompt(seed: int, length: int, vocab: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, length).tolist()


# ---------------------------------------------------------------- the scenarios


async def collect(events) -> list:
    return [event async for event in events]


async def play(player: StepPlayer, *calls, requests: int) -> list:
    """Start the rollout calls, wait until ``requests`` reached the engine, run the steps."""
    tasks = [asyncio.ensure_future(collect(call)) for call in calls]
    for _ in range(5000):
        if len(player.requests) >= requests or any(t.done() for t in tasks):
            break
        await asyncio.sleep(0.001)
    player.run()
    return [event for task in tasks for event in await task]


def stored(events: list) -> list[SampleDone]:
    done = [e for e in events if isinstance(e, SampleDone)]
    assert done and all(d.stored for d in done), events
    return done


async def batch(rollout, player, name, prompts, n, max_tokens) -> list[SampleDone]:
    """``n`` samples of each prompt in one ``generate_batch``, named ``{name}-{i}``; stored."""
    ids = [f"{name}-{i}" for i in range(len(prompts) * n)]
    options = SamplingOptions(max_tokens=max_tokens)
    events = await play(
        player, rollout.generate_batch(prompts, n, options, sample_ids=ids), requests=len(ids)
    )
    done = stored(events)
    assert sorted(d.sample_id for d in done) == sorted(ids), done
    return done


async def plain(rollout, player, name, vocab):
    return [d.sample_id for d in await batch(rollout, player, name, [prompt(1, 10, vocab)], 1, 6)]


async def grpo_group(rollout, player, name, vocab):
    done = await batch(rollout, player, name, [prompt(2, 13, vocab)], 4, 5)
    # The siblings' prompt rows came from the store: the prefix path ran.
    assert sum(d.cached_tokens for d in done) >= 2 * 3 * BLOCK, [d.cached_tokens for d in done]
    return [d.sample_id for d in done]


async def second_turn(rollout, player, name, vocab):
    sid = f"{name}-0"
    await play(
        player,
        rollout.generate_batch(
            [prompt(3, 9, vocab)], 1, SamplingOptions(max_tokens=7), [sid], more_turns=True
        ),
        requests=1,
    )
    events = await play(
        player,
        rollout.continue_sample(sid, prompt(4, 6, vocab), SamplingOptions(max_tokens=5)),
        requests=2,
    )
    (done,) = stored(events)
    assert done.row_start == 9 + 7 - 1 and done.cached_tokens >= 3 * BLOCK, done
    return [sid]


async def chunked_prefill(rollout, player, name, vocab):
    done = await batch(rollout, player, name, [prompt(5, 23, vocab), prompt(6, 18, vocab)], 1, 4)
    return [d.sample_id for d in done]


async def preemption(rollout, player, name, vocab):
    # One preempted in the middle of its prefill, one in the middle of its decoding.
    player.preempt_when[f"{name}-0@"] = lambda r: r.num_computed_tokens >= 10
    player.preempt_when[f"{name}-1@"] = lambda r: r.num_output_tokens >= 3
    prompts = [prompt(7, 21, vocab), prompt(8, 11, vocab), prompt(9, 6, vocab)]
    done = await batch(rollout, player, name, prompts, 1, 6)
    assert player.counts["preempted"] == 2, player.counts
    return [d.sample_id for d in done]


async def speculative(rollout, player, name, vocab):
    done = await batch(rollout, player, name, [prompt(10, 9, vocab), prompt(11, 14, vocab)], 1, 17)
    assert player.counts["drafts_rejected"] >= 6, player.counts
    return [d.sample_id for d in done]


async def small_store(rollout, player, name, vocab):
    done = await batch(rollout, player, name, [prompt(12, 17, vocab)], 3, 4)
    assert sum(d.cached_tokens for d in done) >= 4 * BLOCK
    # It held one block at first; vLLM 0.31/0.32's would have raised here instead of growing.
    assert player.worker._store._store.num_slots >= 17 // BLOCK, "the store did not grow"
    return [d.sample_id for d in done]


async def weight_update(rollout, player, name, vocab, checkpoint):
    same = prompt(13, 14, vocab)
    first = await play(
        player,
        rollout.generate_batch([same], 1, SamplingOptions(max_tokens=5), [f"{name}-0"]),
        requests=1,
    )
    await rollout.update_weights(str(checkpoint), 1)
    second = await play(
        player,
        rollout.generate_batch([same], 1, SamplingOptions(max_tokens=5), [f"{name}-1"]),
        requests=2,
    )
    (before,), (after,) = stored(first), stored(second)
    # The prefix cache and the store's namespace were reset: nothing of version 0 is reused.
    assert (before.turn.policy_version, after.turn.policy_version) == (0, 1)
    assert after.cached_tokens == 0, after
    return [f"{name}-0", f"{name}-1"]


SCENARIOS = {
    "plain": (plain, {}),
    "grpo_group": (grpo_group, {}),
    "second_turn": (second_turn, {}),
    "chunked_prefill": (chunked_prefill, {"max_num_batched_tokens": 5}),
    "preemption": (preemption, {"max_num_batched_tokens": 8}),
    "speculative": (speculative, {"spec_tokens": 3, "accepted": (2, 0, 3, 1)}),
    # One hash block's rows: the store must grow past what one prompt needs.
    "small_store": (small_store, {"store_bytes": "one_block"}),
    "weight_update": (weight_update, {}),
}


# ---------------------------------------------------------------- the check


def expected_routes(record, moe_geometry) -> np.ndarray:
    """Every row the stand-in capture computed for this record's tokens: row ``r`` under the
    policy of the turn that holds token ``r + 1`` (the token that row's forward pass chose)."""
    tokens = record.token_ids
    version = np.zeros(len(tokens), np.int64)
    for turn in record.turns:
        version[turn.token_start : turn.token_end] = turn.policy_version
    moe = list(moe_geometry.record.moe_layers)
    rows = [
        route_rows(int(version[r + 1]), tokens[: r + 1], moe_geometry)
        for r in range(len(version) - 1)
    ]
    return np.stack(rows)[:, moe]


def check_every_row(cache_reader, sample_ids, moe_geometry) -> int:
    rows = 0
    for record in cache_reader.read_batch(sample_ids):
        want = expected_routes(record, moe_geometry)
        assert record.routes.shape == want.shape, (record.sample_id, record.routes.shape)
        bad = np.flatnonzero((record.routes != want).any(axis=(1, 2)))
        assert bad.size == 0, (
            f"{record.sample_id}: {bad.size} of {len(want)} stored rows differ from the "
            f"captured ones, first row {bad[0]}: stored {record.routes[bad[0]].tolist()}, "
            f"captured {want[bad[0]].tolist()}"
        )
        rows += len(want)
    return rows


def run_scenario(version, scenario, tiny_model_dir, route_cache, loop, monkeypatch):
    """Play one scenario on vLLM ``version``'s bookkeeping: (sample ids, geometry, player)."""
    from vllm.v1.engine.async_llm import AsyncLLM

    play_fn, settings = SCENARIOS[scenario]
    settings = dict(settings)
    holder = {}

    async def main():
        # A VLLMEngine whose AsyncLLM is the stand-in over the player: its reader runs.
        def start(args):
            return StandInAsyncLLM(holder["player"], 256, vocab)

        monkeypatch.setattr(AsyncLLM, "from_engine_args", staticmethod(start))
        from routereplay.families.model_geometry import load_geometry

        moe_geometry = load_geometry(tiny_model_dir, "tiny")
        vocab = 512
        if settings.get("store_bytes") == "one_block":
            settings["store_bytes"] = (
                BLOCK * moe_geometry.num_hidden_layers * moe_geometry.record.topk
            )
        holder["player"] = StepPlayer(aux_output(version), moe_geometry, vocab, **settings)
        engine = VLLMEngine(tiny_model_dir, model_id="tiny")
        async with AsyncRouteCacheClient(route_cache.target, timeout_s=10) as cache:
            writer = RecordWriter(cache)
            writer.start()
            try:
                rollout = Rollout(engine, cache, writer, RolloutLimits())
                name = f"aux-{version}-{scenario}-{uuid.uuid4().hex[:8]}"
                extra = (tiny_model_dir,) if play_fn is weight_update else ()
                ids = await play_fn(rollout, holder["player"], name, vocab, *extra)
            finally:
                await writer.stop(5)
        return ids, moe_geometry

    ids, moe_geometry = loop.run_until_complete(main())
    return ids, moe_geometry, holder["player"]


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("version", VERSIONS)
def test_vllm_aux_output_rows_are_stored_as_captured(
    version, scenario, tiny_model_dir, route_cache, cache_reader, loop, monkeypatch
):
    ids, moe_geometry, player = run_scenario(
        version, scenario, tiny_model_dir, route_cache, loop, monkeypatch
    )
    assert check_every_row(cache_reader, ids, moe_geometry) > 0
    assert not player.busy


def test_the_store_probe_on_vllms_own_stores():
    """``aux_output_store_grows`` asked of the real stores: 0.32.0's raises when full (refused),
    0.33.0's and 0.34.0's grow (the V2 path)."""
    assert not aux_output_store_grows(aux_output("0.32.0").store)
    for version in VERSIONS:
        assert aux_output_store_grows(aux_output(version).store)
