"""Each MoE family served by real vLLM with capture on, stored in the real route cache.

One engine per family, started and shut down in turn inside one test (each takes 15-30 s
and about 3 GiB: never two at once from this module). Every record is read back from the
route cache and compared with the transformers oracle on every row and MoE layer; the
dense layers of the raw capture are dropped by the shared geometry rule.
"""

from __future__ import annotations

import asyncio

import pytest

from routereplay.rollout import SampleDone, SamplingOptions
from tests.conftest import OTHER_FAMILIES
from tests.rollout_server.conftest import MAX_NUM_BATCHED_TOKENS, rollout_config
from tests.rollout_server.oracle import assert_record_matches, load_hf_model

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Router replay records the experts that the engine chose.",
]
GREEDY = SamplingOptions(temperature=0.0, max_tokens=8)
SAMPLED = SamplingOptions(temperature=1.0, top_p=0.9, top_k=50, max_tokens=8)
EXPECTED_MOE_LAYERS = {"qwen2_moe": (1, 2, 3), "mixtral": (0, 1, 2, 3), "glm4_moe": (1, 2, 3)}


def _serve_and_check(family, model_dir, route_cache, cache_reader, loop):
    from rollout_server.engine import VLLMEngine
    from rollout_server.server import RolloutServer
    from routereplay.rollout_client import AsyncRolloutClient

    async def start():
        engine = VLLMEngine(
            model_dir, max_model_len=256, max_num_seqs=4,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, enable_chunked_prefill=True, seed=0,
        )  # fmt: skip
        server = await RolloutServer(rollout_config(route_cache.target), engine).start()
        return engine, server, AsyncRolloutClient(f"127.0.0.1:{server.port}", timeout_s=120)

    async def events_of(stream):
        return [event async for event in stream]

    async def generate(client):
        jobs = [client.generate(t, opt) for t in TEXTS for opt in (GREEDY, SAMPLED)]
        return await asyncio.gather(*(events_of(stream) for stream in jobs))

    engine, server, client = loop.run_until_complete(start())
    try:
        assert engine.geometry.moe_layers == EXPECTED_MOE_LAYERS[family]
        hf_model = load_hf_model(model_dir)
        for events in loop.run_until_complete(generate(client)):
            (final,) = [e for e in events if isinstance(e, SampleDone)]
            assert final.stored, final
            record = cache_reader.read(final.sample_id)
            assert record.geometry.moe_layers == EXPECTED_MOE_LAYERS[family]
            assert_record_matches(hf_model, record)
    finally:
        loop.run_until_complete(client.close())
        loop.run_until_complete(server.stop(1))
        engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_family_records_match_the_oracle(family, family_model_dir, route_cache, cache_reader, loop):
    pytest.importorskip("vllm")
    _serve_and_check(family, family_model_dir(family), route_cache, cache_reader, loop)
