"""Fixtures of the trainer tests: the tiny Qwen3-MoE checkpoint and one single-rank gloo world.

megatron-core keeps its parallel state in module globals, so one world serves the whole session;
each test builds its own model (megatron's router-replay registry is reset at every build).
"""

from __future__ import annotations

import pytest
import torch

from trainer.distributed import single_process

# 2 threads on 2 shared cores contend badly (steps 40x slower measured).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def pg_collection(tmp_path_factory):
    """megatron's process groups over a gloo world of one rank."""
    pytest.importorskip("megatron.core")
    rendezvous = tmp_path_factory.mktemp("rendezvous") / "pg"
    groups = single_process.init_single_process(f"file://{rendezvous}", seed=1234)
    yield groups
    single_process.shutdown()


@pytest.fixture(scope="module")
def rollout(tiny_model_dir):
    """2 prompts x 4 samples, 10 generated tokens each, float32 (identical to the trainer's
    natural routing on fresh weights). One per test module, which may change it."""
    from routereplay.dev.hf_rollout import random_prompts, rollout_records

    prompts = random_prompts(2, [5, 8], 512, seed=3)
    return rollout_records(tiny_model_dir, prompts, group_size=4, new_tokens=10, seed=0)


@pytest.fixture(scope="module")
def rollout_file(rollout, tmp_path_factory):
    from routereplay.domain.record_file import save_records

    return save_records(tmp_path_factory.mktemp("rollout") / "rollout.npz", rollout)
