"""The rollout server end to end: real vLLM (CPU), real route cache, real redis-server.

Every route check reads the record BACK FROM THE ROUTE CACHE and compares it with the
transformers oracle (``tests/rollout_server/oracle.py``) on every row and MoE layer.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from dataclasses import replace

import numpy as np
import pytest

from routereplay.domain.rollout import SampleDelta, SampleDone, SampleFailed, SamplingOptions
from routereplay.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    RouteReplayError,
    Unavailable,
)
from routereplay.rpc.rollout_client import AsyncRolloutClient
from tests.rollout_server.conftest import rollout_config
from tests.rollout_server.oracle import assert_record_matches

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Router replay records the experts that the engine chose.",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time there was a small model that lived on a laptop.",
]
GREEDY = SamplingOptions(temperature=0.0, max_tokens=10)
SAMPLED = SamplingOptions(temperature=1.0, top_p=0.9, top_k=50, max_tokens=10)


async def events_of(stream) -> list:
    return [event async for event in stream]


def split(events):
    """Deltas and the final event per sample id, checking order: no delta after the end."""
    deltas: dict[str, list] = {}
    done: dict[str, SampleDone] = {}
    for event in events:
        assert event.sample_id not in done, "event after the sample's final message"
        if isinstance(event, SampleDelta):
            deltas.setdefault(event.sample_id, []).append(event.delta)
        else:
            assert isinstance(event, SampleDone), event
            done[event.sample_id] = event
    return deltas, done


def check_stream(deltas, done: SampleDone, record):
    """Concatenated deltas equal the record's generated tokens; log-probs match."""
    ids = [t for d in deltas for t in d.token_ids]
    turn = done.turn
    assert ids == record.token_ids[turn.generated_start : turn.token_end].tolist()
    assert len(ids) == done.generated_tokens
    lps = [x for d in deltas for x in d.logprobs]
    np.testing.assert_allclose(lps, turn.logprobs, rtol=0, atol=0)
    assert done.stored and not done.store_error
    assert done.num_tokens == record.num_tokens


def test_generate_streams_and_stores_oracle_routes(rollout, cache_reader, hf_model, loop):
    server, client = rollout
    jobs = [(text, opt) for text in TEXTS for opt in (GREEDY, SAMPLED)]

    async def run():  # several clients at once
        clients = [AsyncRolloutClient(f"127.0.0.1:{server.port}") for _ in jobs]
        try:
            return await asyncio.gather(
                *(
                    events_of(c.generate(text, opt, return_routes=True))
                    for c, (text, opt) in zip(clients, jobs, strict=True)
                )
            )
        finally:
            await asyncio.gather(*(c.close() for c in clients))

    version = server.rollout.policy_version
    for events in loop.run_until_complete(run()):
        deltas, done = split(events)
        ((sid, final),) = done.items()
        record = cache_reader.read(sid)
        check_stream(deltas[sid], final, record)
        assert_record_matches(hf_model, record)
        assert len(record.turns) == 1 and record.turns[0].policy_version == version
        assert record.turns[0].generated_start == final.prompt_tokens
        assert record.geometry.moe_layers == (1, 2, 3)  # layer 0 is dense: dropped
        assert final.row_start == 0 and (final.routes == record.routes).all()


def test_token_id_prompt_and_caller_sample_id(rollout, cache_reader, hf_model, loop, vllm_engine):
    _, client = rollout
    prompt = vllm_engine.tokenizer.encode(TEXTS[2])
    sid = f"given-{uuid.uuid4().hex[:8]}"
    events = loop.run_until_complete(
        events_of(client.generate(prompt, GREEDY, sample_id=sid, group_id="g1"))
    )
    _, done = split(events)
    assert list(done) == [sid] and done[sid].routes is None
    record = cache_reader.read(sid)
    assert record.group_id == "g1"
    assert record.token_ids[: len(prompt)].tolist() == prompt
    assert_record_matches(hf_model, record)


def test_chunked_prefill_and_prefix_cache_hits(
    rollout, cache_reader, hf_model, loop, vllm_engine, max_num_batched_tokens
):
    _, client = rollout
    tok = vllm_engine.tokenizer
    prefix = tok.encode(" ".join(TEXTS) * 6)[:200]
    assert len(prefix) > 4 * max_num_batched_tokens  # prefilled in chunks
    for tail in (" What is two plus two?", " What colour is the sky?"):
        events = loop.run_until_complete(
            events_of(client.generate(prefix + tok.encode(tail), GREEDY))
        )
        _, done = split(events)
        ((sid, final),) = done.items()
        assert final.stored
        assert_record_matches(hf_model, cache_reader.read(sid))
    assert final.cached_tokens >= 64, "the second request should hit the prefix cache"


def test_batch_groups_of_n(rollout, cache_reader, hf_model, loop):
    _, client = rollout
    n, groups = 3, [f"grp-{uuid.uuid4().hex[:6]}", f"grp-{uuid.uuid4().hex[:6]}"]
    events = loop.run_until_complete(
        events_of(client.generate_batch(TEXTS[:2], n, SAMPLED, group_ids=groups))
    )
    deltas, done = split(events)
    assert len(done) == 2 * n
    by_group = {g: [d for d in done.values() if d.group_id == g] for g in groups}
    assert all(len(v) == n for v in by_group.values())
    for sid, final in done.items():
        record = cache_reader.read(sid)
        assert record.group_id == final.group_id
        check_stream(deltas[sid], final, record)
        assert_record_matches(hf_model, record)


def test_multi_turn_equals_single_shot_oracle(rollout, cache_reader, hf_model, loop, vllm_engine):
    _, client = rollout
    tok = vllm_engine.tokenizer
    first = loop.run_until_complete(events_of(client.generate(TEXTS[0], SAMPLED)))
    _, done1 = split(first)
    ((sid, final1),) = done1.items()
    turn2_prompt = tok.encode(" Questions and answers. What is two plus two?")
    second = loop.run_until_complete(
        events_of(client.continue_sample(sid, turn2_prompt, GREEDY, return_routes=True))
    )
    deltas2, done2 = split(second)
    final2 = done2[sid]
    record = cache_reader.read(sid)
    t1 = final1.num_tokens
    assert final2.stored and final2.num_tokens == record.num_tokens
    assert record.num_tokens == t1 + len(turn2_prompt) + final2.generated_tokens
    assert record.token_ids[t1 : t1 + len(turn2_prompt)].tolist() == turn2_prompt
    assert [(t.token_start, t.token_end) for t in record.turns] == [
        (0, t1),
        (t1, record.num_tokens),
    ]
    assert record.turns[1].generated_start == t1 + len(turn2_prompt)
    # The previous turn's last token got its row now; the inline rows are the appended ones.
    assert final2.row_start == t1 - 1
    assert (final2.routes == record.routes[t1 - 1 :]).all()
    check_stream(deltas2[sid], final2, record)
    assert_record_matches(hf_model, record)  # the whole conversation, single shot


def test_client_cancel_stops_generation_and_stores_nothing(rollout, cache_reader, loop):
    server, client = rollout
    sid = f"cancel-{uuid.uuid4().hex[:8]}"
    before = server.rollout.counters["samples_cancelled"]

    async def run():
        got = 0
        stream = client.generate(TEXTS[1], SamplingOptions(temperature=1.0, max_tokens=400), sid)
        async for event in stream:
            assert isinstance(event, SampleDelta)
            got += len(event.delta.token_ids)
            if got >= 3:
                break
        await stream.aclose()  # cancels the call
        for _ in range(100):  # the server notices the cancellation
            if server.rollout.num_running == 0:
                break
            await asyncio.sleep(0.05)

    loop.run_until_complete(run())
    assert server.rollout.num_running == 0
    assert server.rollout.counters["samples_cancelled"] == before + 1
    with pytest.raises(NotFound):
        cache_reader.stat(sid)


@pytest.mark.parametrize(
    "call,error,words",
    [
        (dict(prompt=""), InvalidArgument, "prompt is empty"),
        (dict(prompt=[]), InvalidArgument, "prompt is empty"),
        (dict(options=SamplingOptions(max_tokens=0)), InvalidArgument, "max_tokens"),
        (dict(options=SamplingOptions(max_tokens=-3)), InvalidArgument, "max_tokens"),
        (dict(options=SamplingOptions(max_tokens=600)), InvalidArgument, "max_tokens"),
        (dict(prompt=[5] * 600), InvalidArgument, "context"),
        (dict(prompt=[5, 100000]), InvalidArgument, "prompt.token_ids[1]"),
        (dict(options=SamplingOptions(seed=7)), InvalidArgument, "sampling.seed"),
        (dict(options=SamplingOptions(top_p=0)), InvalidArgument, "sampling.top_p"),
        (dict(options=SamplingOptions(stop=["x", ""])), InvalidArgument, "sampling.stop[1]"),
        (dict(sample_id="has space"), InvalidArgument, "sample_id"),
    ],
)
def test_bad_generate_input(rollout, loop, call, error, words):
    _, client = rollout
    args = {"prompt": "hello", "options": GREEDY, **call}
    with pytest.raises(error) as info:
        loop.run_until_complete(
            events_of(client.generate(args["prompt"], args["options"], args.get("sample_id", "")))
        )
    assert words in str(info.value)


def test_bad_batch_continue_and_duplicate_ids(rollout, loop):
    server, client = rollout
    with pytest.raises(InvalidArgument, match=r"^n is 9"):
        loop.run_until_complete(events_of(client.generate_batch(["a"], 9, GREEDY)))
    with pytest.raises(InvalidArgument, match="sample_ids"):
        loop.run_until_complete(events_of(client.generate_batch(["a"], 2, GREEDY, ["x"])))
    with pytest.raises(NotFound, match="no-such-sample"):
        loop.run_until_complete(events_of(client.continue_sample("no-such-sample", "hi", GREEDY)))
    sid = f"dup-{uuid.uuid4().hex[:8]}"
    loop.run_until_complete(events_of(client.generate("hello", GREEDY, sid)))
    with pytest.raises(AlreadyExists, match=sid):
        loop.run_until_complete(events_of(client.generate("hello", GREEDY, sid)))
    with pytest.raises(AlreadyExists, match=sid):
        loop.run_until_complete(events_of(client.generate_batch(["a"], 2, GREEDY, ["fresh", sid])))

    async def two_at_once():  # the same new id twice, concurrently: one is refused
        dup = f"dup2-{uuid.uuid4().hex[:8]}"
        return await asyncio.gather(
            events_of(client.generate("hello", SAMPLED, dup)),
            events_of(client.generate("hello", SAMPLED, dup)),
            return_exceptions=True,
        )

    results = loop.run_until_complete(two_at_once())
    assert sum(isinstance(r, AlreadyExists) for r in results) == 1
    assert server.rollout.num_running == 0


def test_bad_capture_is_never_stored(rollout, cache_reader, loop, monkeypatch):
    """Simulate the known silent failure (a block of zeros) inside the engine's capture."""
    from rollout_server import engine as engine_module

    real = engine_module.validate_routes

    def zeroed(routes, moe_geometry, rows):
        return real(None if routes is None else np.zeros_like(routes), moe_geometry, rows)

    server, client = rollout
    monkeypatch.setattr(engine_module, "validate_routes", zeroed)
    sid = f"bad-{uuid.uuid4().hex[:8]}"
    with pytest.raises(RouteReplayError) as info:
        loop.run_until_complete(events_of(client.generate("hello", GREEDY, sid)))
    assert info.value.status == "INTERNAL" and "repeat" in str(info.value)
    events = loop.run_until_complete(events_of(client.generate_batch(["hello"], 2, GREEDY)))
    failed = [e for e in events if isinstance(e, SampleFailed)]
    assert len(failed) == 2 and all(e.code == "INTERNAL" for e in failed)
    monkeypatch.undo()
    with pytest.raises(NotFound):
        cache_reader.stat(sid)
    status = loop.run_until_complete(client.status())
    assert status.counters["capture_failures"] >= 3
    assert status.running == 0


def test_route_cache_restart_during_generation(rollout, route_cache, cache_reader, hf_model, loop):
    """The cache goes away mid-generation and comes back: the record still lands."""
    server, client = rollout
    retries = server.rollout.writer.counters["write_retries"]

    async def run():
        restarted = threading.Event()
        events = []
        stream = client.generate(TEXTS[3], SamplingOptions(temperature=1.0, max_tokens=60))
        async for event in stream:
            events.append(event)
            if len(events) == 1:
                route_cache.stop()

                def restart():
                    time.sleep(2.0)
                    route_cache.start()
                    restarted.set()

                threading.Thread(target=restart, daemon=True).start()
        return events, restarted.is_set()

    events, restarted_before_end = loop.run_until_complete(run())
    _, done = split(events)
    ((sid, final),) = done.items()
    assert restarted_before_end or final.stored
    assert final.stored, final.store_error
    assert server.rollout.writer.counters["write_retries"] > retries
    assert_record_matches(hf_model, cache_reader.read(sid))


def test_backpressure_refuses_with_unavailable(vllm_engine, loop):
    """A cache that is down: writes pile up to the limit, then new calls get UNAVAILABLE, and
    nothing is ever reported as stored."""
    from rollout_server.server import RolloutServer
    from routereplay.dev.launch import free_port

    config = rollout_config(
        f"127.0.0.1:{free_port()}",
        max_pending_writes=1,
        store_wait_s=0.3,
        write_retry_s=30,
        cache_timeout_s=1,
    )

    async def run():
        server = await RolloutServer(config, vllm_engine).start()
        client = AsyncRolloutClient(f"127.0.0.1:{server.port}")
        try:
            first = await events_of(client.generate("hello", GREEDY))
            with pytest.raises(Unavailable, match="record writes"):
                await events_of(client.generate("hello", GREEDY))
            status = await client.status()
            return first, status
        finally:
            await client.close()
            await server.stop(0.2)

    first, status = loop.run_until_complete(run())
    _, done = split(first)
    ((_, final),) = done.items()
    assert not final.stored and "retried" in final.store_error
    assert status.pending_writes == 1 and status.counters["refused_backpressure"] == 1


def test_a_route_cache_at_its_memory_budget_holds_writes_and_admission(vllm_engine, loop):
    """A real route cache whose Redis is at its memory budget: the sample generated meanwhile
    waits in the writer (not failed, past ``write_retry_s`` too), new calls are refused with
    RESOURCE_EXHAUSTED saying why, and once the trainer's group commits what it trained (the
    records freed) the held record lands whole and generation is admitted again."""
    from rollout_server.server import RolloutServer
    from route_cache.config import Config as CacheConfig
    from route_cache.connection import connect
    from route_cache.server import RouteCacheServer
    from route_cache.store import RouteStore
    from routereplay.dev.redis_nodes import RedisProcess
    from routereplay.dev.synthetic import QWEN3_30B_A3B, synthetic_record
    from routereplay.errors import ResourceExhausted
    from routereplay.rpc.client import RouteCacheClient
    from routereplay.rpc.ready import ReadyConsumer

    node = RedisProcess("--maxmemory", "4mb", "--maxmemory-policy", "noeviction").start()
    store = RouteStore(connect(node.url, cluster=False), ttl_ms=600_000)
    cache_config = CacheConfig(
        host="127.0.0.1",
        port=0,
        grace_s=1,
        memory_budget=0.5,
        commit_groups="trainer",
        free_grace_s=0,
    )
    cache = RouteCacheServer(cache_config, store).start()
    target = f"127.0.0.1:{cache.port}"
    feeder = RouteCacheClient(target, timeout_s=10)
    # Other samples' records, written past the budget through a route cache without one (on
    # the same Redis and ready stream), so that Redis's own small ups and downs cannot bring
    # it back under the budget before the trainer commits.
    unbudgeted = RouteCacheServer(replace(cache_config, memory_budget=0), store).start()
    filled, rng = 0, np.random.default_rng(0)
    with RouteCacheClient(f"127.0.0.1:{unbudgeted.port}", timeout_s=10) as writer:
        while cache.budget.read()["redis"].used < 0.6 * 4 * 2**20:
            writer.write(synthetic_record(f"fill-{filled}", QWEN3_30B_A3B, 300, rng))
            filled += 1
    unbudgeted.stop(0)
    config = rollout_config(target, store_wait_s=0.5, write_retry_s=1, cache_timeout_s=2)

    async def run():
        server = await RolloutServer(config, vllm_engine).start()
        client = AsyncRolloutClient(f"127.0.0.1:{server.port}")
        try:
            first = await events_of(client.generate("hello", GREEDY))
            await asyncio.sleep(1.5)  # past write_retry_s: still held, not given up
            with pytest.raises(ResourceExhausted, match="wait here for room") as refused:
                await events_of(client.generate("hello", GREEDY))
            assert refused.value.retry_after_s > 0
            held = server.rollout.writer.held_for_memory
            trainer = ReadyConsumer(feeder, "trainer", "t0", 1, max_entries=256, block_ms=200)
            assert len(trainer.settle(trainer.next_groups(filled, timeout_s=10))) == filled
            cache.budget.read()
            for _ in range(100):
                if not server.rollout.writer.num_pending:
                    break
                await asyncio.sleep(0.1)
            again = await events_of(client.generate("hello", GREEDY))
            return first, held, again, server.rollout.writer.counters
        finally:
            await client.close()
            await server.stop(0.5)

    try:
        first, held, again, counters = loop.run_until_complete(run())
        ((sid, final),) = split(first)[1].items()
        assert not final.stored and held == 1
        assert feeder.stat(sid).num_tokens == final.num_tokens  # landed whole afterwards
        ((_, done),) = split(again)[1].items()
        assert done.stored
        assert counters["writes_failed"] == 0 and counters["writes_held_for_memory"] >= 1
    finally:
        feeder.close()
        cache.stop(0)
        store.client.close()
        node.stop()


def test_server_status(rollout, loop):
    _, client = rollout
    status = loop.run_until_complete(client.status())
    assert list(status.geometry.moe_layers) == [1, 2, 3]
    assert status.max_model_len == 512 and status.counters["samples_stored"] > 0


def test_continue_while_generating_is_refused(rollout, loop):
    _, client = rollout
    sid = f"busy-{uuid.uuid4().hex[:8]}"

    async def run():
        stream = client.generate("hello", SamplingOptions(temperature=1.0, max_tokens=200), sid)
        await stream.__anext__()
        try:
            with pytest.raises(FailedPrecondition, match="generating"):
                await events_of(client.continue_sample(sid, "more", GREEDY))
        finally:
            await stream.aclose()

    loop.run_until_complete(run())


def test_a_multi_turn_sample_is_announced_on_the_feed_once_complete(rollout, route_cache, loop):
    """``more_turns`` keeps a sample off the ready feed until the turn marked ``final``; a
    plain sample is announced after its one turn."""
    _, client = rollout
    redis = route_cache.store.client  # the route cache's ready stream, read directly
    group = f"g-{uuid.uuid4().hex[:8]}"

    def announced() -> list[tuple[str, str, str]]:
        entries = redis.xrange("rr:ready")
        return [
            (f[b"sample_id"].decode(), f[b"num_tokens"].decode(), f[b"policy_versions"].decode())
            for _, f in entries
            if f[b"group_id"].decode() == group
        ]

    async def run():
        _, done = split(
            await events_of(
                client.generate_batch([TEXTS[0]], 2, GREEDY, group_ids=[group], more_turns=True)
            )
        )
        assert announced() == []
        multi, _ = sorted(done)
        middle = split(await events_of(client.continue_sample(multi, " Then", GREEDY)))[1]
        assert announced() == []
        last = split(await events_of(client.continue_sample(multi, " End", GREEDY, final=True)))
        return done, middle[multi], last[1][multi]

    done, middle, last = loop.run_until_complete(run())
    assert middle.stored and last.stored
    version = str(last.turn.policy_version)
    assert announced() == [(last.sample_id, str(last.num_tokens), ",".join([version] * 3))]
    assert last.num_tokens > middle.num_tokens > done[last.sample_id].num_tokens


def test_metrics_endpoint(vllm_engine, route_cache, loop):
    """A real HTTP scrape of a rollout server with metrics on: the calls, the tokens generated
    and the stored samples move with a generation; the policy version is exported."""
    from rollout_server.server import RolloutServer
    from routereplay.rpc.metrics import MetricsConfig
    from tests.support.metrics import scrape

    metrics = MetricsConfig(True, "127.0.0.1", 0)  # a free port
    config = rollout_config(route_cache.target, metrics=metrics, policy_version=7)

    def value(samples, name, **labels):
        return samples.get((name, tuple(sorted(labels.items()))), 0.0)

    async def run():
        server = await RolloutServer(config, vllm_engine).start()
        client = AsyncRolloutClient(f"127.0.0.1:{server.port}")
        url = f"http://127.0.0.1:{server.metrics.port}/metrics"
        try:
            before = await asyncio.to_thread(scrape, url)
            _, done = split(await events_of(client.generate("hello", GREEDY)))
            await client.status()
            return before, await asyncio.to_thread(scrape, url), done
        finally:
            await client.close()
            await server.stop(1)

    before, after, done = loop.run_until_complete(run())
    ((_, final),) = done.items()
    assert final.stored

    def moved(name, **labels):
        return value(after, name, **labels) - value(before, name, **labels)

    events = "rollout_server_events_total"
    assert moved(events, event="tokens_generated") == final.generated_tokens > 0
    assert moved(events, event="samples_stored") == 1
    assert moved("rollout_server_rpc_calls_total", method="GetStatus", code="OK") == 1
    assert moved("rollout_server_rpc_latency_seconds_count", method="GetStatus") == 1
    assert value(after, "rollout_server_policy_version") == 7
    assert value(after, "rollout_server_pending_writes") == 0
