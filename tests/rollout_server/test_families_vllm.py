"""Each MoE family served by real vLLM with capture on, stored in the real route cache, and
trained on by the real trainer.

One engine per family, started and shut down in turn inside one test (each takes 15-30 s
and about 3 GiB: never two at once from this module). Every record is read back from the
route cache and compared with the transformers oracle on every row and MoE layer; the
dense layers of the raw capture are dropped by the shared geometry rule. Then
``python -m trainer`` (float32, one rank, R3) trains one step on those records, read from the
route cache: its natural routing equals vLLM's on every MoE layer and its routers follow the
replayed routes; its export is pushed to the server (``UpdateWeights``), and the next records
match the exported checkpoint's oracle on every MoE layer, and no longer the old one's.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path

import pytest

from routereplay.domain.rollout import SampleDone, SamplingOptions
from tests.conftest import OTHER_FAMILIES
from tests.rollout_server.conftest import MAX_NUM_BATCHED_TOKENS, rollout_config
from tests.rollout_server.oracle import (
    agreement,
    assert_record_matches,
    load_hf_model,
    oracle,
)
from trainer.report.step_report import reports_from_json

ROOT = Path(__file__).resolve().parents[2]

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Router replay records the experts that the engine chose.",
]
# 16 new tokens: with 8, the tiny DeepSeek-V2's 4 samples drew no rewarded token (ids that are
# multiples of 8), so every advantage was 0, the step changed nothing and the push could not
# be told from the old checkpoint.
GREEDY = SamplingOptions(temperature=0.0, max_tokens=16)
SAMPLED = SamplingOptions(temperature=1.0, top_p=0.9, top_k=50, max_tokens=16)
# The MTP layer of GLM-4.5 and DeepSeek-V3 (model.layers.4) is no decoder layer: no column of
# its own.
EXPECTED_MOE_LAYERS = {
    "qwen2_moe": (1, 2, 3),
    "mixtral": (0, 1, 2, 3),
    "glm4_moe": (1, 2, 3),
    "gpt_oss": (0, 1, 2, 3),
    "deepseek_v3": (1, 2, 3),
    "deepseek_v2": (1, 2, 3),
}


def _serve_and_check(family, model_dir, route_cache, cache_reader, loop, work_dir):
    from rollout_server.engine import VLLMEngine
    from rollout_server.server import RolloutServer
    from routereplay.rpc.rollout_client import AsyncRolloutClient

    async def start():
        engine = VLLMEngine(
            model_dir,
            max_model_len=256,
            max_num_seqs=4,
            max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
            enable_chunked_prefill=True,
            seed=0,
        )
        server = await RolloutServer(rollout_config(route_cache.target), engine).start()
        return engine, server, AsyncRolloutClient(f"127.0.0.1:{server.port}", timeout_s=120)

    async def events_of(stream):
        return [event async for event in stream]

    async def generate(client):
        jobs = [client.generate(t, opt) for t in TEXTS for opt in (GREEDY, SAMPLED)]
        finals = []
        for events in await asyncio.gather(*(events_of(stream) for stream in jobs)):
            (final,) = [e for e in events if isinstance(e, SampleDone)]
            assert final.stored, final
            finals.append(final)
        return finals

    engine, server, client = loop.run_until_complete(start())
    try:
        assert engine.geometry.moe_layers == EXPECTED_MOE_LAYERS[family]
        hf_model = load_hf_model(model_dir)
        finals = loop.run_until_complete(generate(client))
        for final in finals:
            record = cache_reader.read(final.sample_id)
            assert record.geometry.moe_layers == EXPECTED_MOE_LAYERS[family]
            assert_record_matches(hf_model, record)
        version = server.rollout.policy_version
        ids = [final.sample_id for final in finals]
        # The trainer pushes while the server answers on this loop.
        report, export = loop.run_until_complete(
            _train_and_push(
                model_dir, route_cache.target, f"127.0.0.1:{server.port}", ids, work_dir
            )
        )
        n_layers = len(EXPECTED_MOE_LAYERS[family])
        assert report.agreement.exact == [1.0] * n_layers  # trainer natural = vLLM's
        assert report.replay_followed.exact == [1.0] * n_layers
        assert report.policy_versions == [version + 1]
        hf_new = load_hf_model(export)
        stale = 0
        for final in loop.run_until_complete(generate(client)):
            assert final.turn.policy_version == version + 1
            record = cache_reader.read(final.sample_id)
            assert_record_matches(hf_new, record)
            stale += _differs(hf_model, record)
        # The step changed what the old checkpoint would have computed on these tokens.
        assert stale > 0
    finally:
        loop.run_until_complete(client.close())
        loop.run_until_complete(server.stop(1))
        engine.shutdown()


async def _train_and_push(model_dir, cache_target, server_target, ids, work_dir: Path):
    """One R3 step of ``python -m trainer`` on the stored samples, its export pushed to the
    server. Returns the step's report and the export folder."""
    args = [
        "-m",
        "trainer",
        f"model.path={model_dir}",
        f"route_cache.target={cache_target}",
        "router_replay.mode=R3",
        f"train.batch_size={len(ids)}",
        "train.micro_batch_size=2",
        "train.lr=1e-2",
        f"train.export_dir={work_dir / 'export'}",
        f"push.targets={server_target}",
        "--ids",
        ",".join(ids),
        "--steps",
        "1",
        "--report",
        str(work_dir / "report.json"),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("WORLD_SIZE", None)
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        *args,
        cwd=ROOT,
        env=env,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await asyncio.wait_for(proc.communicate(), timeout=300)
    assert proc.returncode == 0, out.decode(errors="replace")[-6000:]
    (report,) = reports_from_json(json.loads((work_dir / "report.json").read_text()))
    export = work_dir / "export"
    return report, export / (export / "latest").read_text().strip()


def _differs(hf_model, record) -> bool:
    """Whether the record's routes or log-probs differ from ``hf_model``'s oracle."""
    import numpy as np

    tokens = record.token_ids.tolist()
    routes, logprobs = oracle(hf_model, record.geometry, tokens[:-1])
    if (agreement(record.routes, routes) < 1.0).any():
        return True
    (turn,) = record.turns
    positions = np.arange(turn.generated_start - 1, turn.token_end - 1)
    ref = logprobs[positions, record.token_ids[turn.generated_start : turn.token_end]]
    return bool(np.abs(turn.logprobs - ref).max() > 1e-3)


@pytest.mark.slow
@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_family_records_match_the_oracle_before_and_after_a_trained_push(
    family, family_model_dir, route_cache, cache_reader, loop, tmp_path
):
    pytest.importorskip("vllm")
    pytest.importorskip("megatron.core")
    _serve_and_check(family, family_model_dir(family), route_cache, cache_reader, loop, tmp_path)
