"""What gpt-oss adds to the families' checks (float32, CPU, one rank).

Parity with transformers (logits, natural top-k, padding on both sides) and the weight round
trip are in test_model_parity.py; replay (R2, R3) in test_families.py; layouts in
test_family_layouts.py. Here: megatron's sliding-window layers keep the caller's mask (they
dropped it: megatron_fixes 2), gradients reach what gpt-oss adds, replayed routes are weighted
by the softmax over the replayed experts' own biased logits, YaRN reaches megatron, and
settings the mapping cannot reproduce are refused by name.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from routereplay.families.gpt_oss import TINY_SLIDING_WINDOW
from tests.trainer.helpers import (
    next_token_loss,
    one_hot,
    random_batch,
    replay_random_routes,
)
from trainer.layout.batch import PaddedBatch
from trainer.model.build import build_model
from trainer.model.hf_config import UnsupportedConfig, check_config, read_hf_config

ATOL = 1e-5


@pytest.fixture(scope="module")
def model_dir(family_model_dir):
    return family_model_dir("gpt_oss")


@pytest.fixture(scope="module")
def built(model_dir, pg_collection):
    return build_model(model_dir, routing_replay=True, pg_collection=pg_collection)


def _logits(model, batch: PaddedBatch) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(batch.token_ids, batch.position_ids(), batch.attention_mask())


def test_left_padded_samples_equal_each_sample_alone(built):
    """megatron 0.16.1 replaced the caller's mask with the window mask in windowed layers, so
    a left-padded sample attended to the padding inside its window (max |dlogit| 1.16 on
    this model without megatron_fixes 2). Each sample is longer than the window."""
    lengths = [3 * TINY_SLIDING_WINDOW, TINY_SLIDING_WINDOW + 3, 2 * TINY_SLIDING_WINDOW]
    batch = random_batch(11, lengths, "left")
    logits = _logits(built.model, batch)
    worst = 0.0
    for b in range(batch.batch_size):
        alone = PaddedBatch.from_samples(["x"], [batch.sample_tokens(b).numpy()], pad_id=1)
        start, n = int(batch.starts[b]), int(batch.lengths[b])
        diff = (logits[b, start : start + n] - _logits(built.model, alone)[0]).abs().max()
        worst = max(worst, float(diff))
    print(f"max |dlogit| left-padded vs alone: {worst:.2e}")
    assert worst <= ATOL


def test_gradients_reach_sinks_biases_and_router(built):
    """A training forward and backward (megatron's expert bias was added in place into an
    autograd view and raised: megatron_fixes 3) reach every gpt-oss parameter."""
    built.model.train().zero_grad(set_to_none=True)
    with built.replay.step():
        next_token_loss(built.model, random_batch(4, [12, 9], "right")).backward()
    params = dict(built.model.named_parameters())
    layer = "decoder.layers.0."
    for name in [
        "self_attention.core_attention.softmax_offset",
        "self_attention.linear_qkv.bias",
        "self_attention.linear_proj.bias",
        "mlp.router.bias",
        "mlp.experts.local_experts.0.linear_fc1.bias",
        "mlp.experts.local_experts.0.linear_fc2.bias",
    ]:
        grad = params[layer + name].grad
        assert grad is not None and grad.abs().sum() > 0, name
    built.model.zero_grad(set_to_none=True)


def test_forced_routes_are_weighted_by_the_softmax_of_their_own_biased_logits(built):
    geometry = built.geometry
    batch = random_batch(2, [10, 6, 8], "right")
    aligned, rows, maps, logits, probs = replay_random_routes(built, batch, 100)
    for j, r in enumerate(built.routers):
        ids = aligned.indices[j][rows].long()
        assert torch.equal(maps[r.layer][0][rows], one_hot(ids, geometry.num_experts))
        # The gating logits include the router bias (x @ W.T + b).
        expected = torch.softmax(logits[r.layer][0][rows].gather(1, ids), dim=-1)
        torch.testing.assert_close(probs[r.layer][rows].gather(1, ids), expected)


def test_yarn_and_the_window_reach_megatron(built):
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import (
        YarnRotaryEmbedding,
    )

    config = built.model.config
    assert isinstance(built.model.rotary_pos_emb, YarnRotaryEmbedding)
    assert config.yarn_rotary_scaling_factor == 32.0
    assert config.yarn_correction_range_round_to_int is False  # truncate: false
    assert config.window_size == (TINY_SLIDING_WINDOW - 1, 0)
    # transformers' layer_types: sliding on layers 0 and 2, full on 1 and 3.
    windows = [
        layer.self_attention.core_attention.scale_mask_softmax.window_size
        for layer in built.model.decoder.layers
    ]
    window = (TINY_SLIDING_WINDOW - 1, 0)
    assert windows == [window, None, window, None]


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"layer_types": ["full_attention"] * 4}, "layer_types"),
        ({"swiglu_limit": 10.0}, "swiglu_limit"),
        ({"attention_bias": False}, "attention_bias"),
        ({"quantization_config": {"quant_method": "mxfp4"}}, "dequantize"),
        ({"experts_per_token": 4}, "experts_per_token"),
        ({"sliding_window": None}, "sliding_window"),
        (
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "rope_theta": 1e4,
                    "factor": 4.0,
                    "original_max_position_embeddings": 64,
                    "mscale": 2.0,
                }
            },
            "mscale",
        ),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "longrope"),
    ],
)
def test_settings_megatron_cannot_reproduce_are_refused(model_dir, changes, match):
    config = read_hf_config(model_dir)
    config.update(changes)
    with pytest.raises(UnsupportedConfig, match=match):
        check_config(config)


# One process per vector width, sharing an inductor cache: the second finds the first's entries.
_ACTIVATION = """
import sys, torch
from trainer.model.hf_config import read_checkpoint_config, transformer_config
act = transformer_config(read_checkpoint_config(sys.argv[1]), routing_replay=True).activation_func
for rows in (1, 5, 17, 33):  # the tokens an expert gets vary, so do the compiled shapes
    x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(rows)) * 4
    torch.testing.assert_close(act(x), x * torch.sigmoid(1.702 * x), rtol=1e-6, atol=1e-6)
"""


@pytest.mark.slow
@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() != "AVX512",
    reason="needs a CPU with AVX-512 to run both vector widths",
)
@pytest.mark.parametrize("order", [("AVX512", "avx2"), ("avx2", "AVX512")])
def test_the_expert_activation_is_right_whatever_vector_width_ran_before(
    model_dir, order, tmp_path
):
    """The experts' gate activation under ``ATEN_CPU_CAPABILITY=avx2`` after a run with
    AVX-512 kernels on the same machine and user, and the reverse. Megatron's torch.compile'd
    quick_gelu gave NaN losses in the first order (an AVX-512 kernel rebuilt for AVX2 left half
    its outputs unwritten) and heap corruption in the second."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    env = dict(os.environ, PYTHONPATH=str(root), TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "cache"))
    for capability in order:
        env["ATEN_CPU_CAPABILITY"] = capability
        proc = subprocess.run(
            [sys.executable, "-c", _ACTIVATION, str(model_dir)],
            env=env,
            cwd=root,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert proc.returncode == 0, f"{capability}: {proc.stderr[-3000:]}"
