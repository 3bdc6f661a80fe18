"""DeepSeek-V2/V3 particulars (float32, CPU, one rank): what megatron cannot reproduce is
refused by name, Kimi-K2 is DeepSeek-V3 under its own names, V2's group limit matters.

Parity with transformers (both families) is in test_model_parity.py; replay, R2 and the
layouts run for them through ``OTHER_FAMILIES`` in test_families.py and test_family_layouts.py;
the multi-token-prediction layer (V3's and GLM-4.5's) in test_mtp.py.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("megatron.core")

from tests.trainer.helpers import (
    capture_routing,
    next_token_loss,
    one_hot,
    random_batch,
    replay_random_routes,
)
from trainer.model.build import build_model
from trainer.model.hf_config import UnsupportedConfig, check_config, read_hf_config


def _config(family_model_dir, family, **changes):
    config = read_hf_config(family_model_dir(family))
    config.update(changes)
    return config


@pytest.mark.parametrize(
    ("family", "changes", "match"),
    [
        ("deepseek_v3", {"topk_method": "greedy"}, "topk_method"),
        ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func"),
        ("deepseek_v3", {"norm_topk_prob": False}, "norm_topk_prob"),
        ("deepseek_v3", {"topk_group": 1}, "top 2"),
        ("deepseek_v3", {"rope_interleave": False}, "rope_interleave"),
        ("deepseek_v3", {"rms_norm_eps": 1e-5}, "rms_norm_eps"),
        ("deepseek_v3", {"attention_bias": True}, "attention_bias"),
        ("deepseek_v3", {"moe_layer_freq": 2}, "moe_layer_freq"),
        ("deepseek_v3", {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
        (
            "deepseek_v3",
            {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
            "mscale",
        ),
        ("deepseek_v2", {"topk_group": 2}, "best one"),
        ("deepseek_v2", {"norm_topk_prob": True}, "norm_topk_prob"),
        ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method"),
    ],
)
def test_settings_megatron_cannot_reproduce_are_refused(family_model_dir, family, changes, match):
    config = _config(family_model_dir, family, **changes)
    with pytest.raises(UnsupportedConfig, match=match):
        check_config(config)


def _kimi_form(src, dst):
    """The tiny DeepSeek-V3 as Kimi-K2's config.json writes it: model_type ``kimi_k2``, rope
    in transformers 4's terms (top-level ``rope_theta``, ``rope_scaling`` with ``type``)."""
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    rope["type"] = rope.pop("rope_type")
    config.update(model_type="kimi_k2", rope_scaling=rope)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_kimi_k2_is_deepseek_v3_under_its_own_names(family_model_dir, pg_collection, tmp_path):
    src = family_model_dir("deepseek_v3")
    kimi = _kimi_form(src, tmp_path / "kimi")
    batch = random_batch(4, [9, 6], "right")
    logits = []
    for folder in (src, kimi):
        built = build_model(folder, routing_replay=False, pg_collection=pg_collection)
        with torch.no_grad():
            logits.append(
                built.model.eval()(batch.token_ids, batch.position_ids(), batch.attention_mask())
            )
        assert built.geometry.moe_layers == (1, 2, 3)
    assert torch.equal(logits[0], logits[1])


def test_deepseek_v2_router_uses_its_group_limit(family_model_dir, pg_collection):
    """On some tokens V2's natural choice (group-limited greedy) differs from the plain top-k
    of the softmax: the group limit matters to parity and replay on the tiny model; and forced
    routes are weighted by the softmax over all experts, not renormalised, times the scaling
    factor."""
    built = build_model(
        family_model_dir("deepseek_v2"), routing_replay=True, pg_collection=pg_collection
    )
    geometry = built.geometry
    batch = random_batch(5, [16, 16], "right")
    with torch.no_grad(), capture_routing(built.routers) as (maps, logits):
        next_token_loss(built.model, batch)
    differs = False
    for r in built.routers:
        scores = torch.softmax(logits[r.layer][0], dim=-1)
        plain = one_hot(scores.topk(geometry.topk, dim=-1).indices, geometry.num_experts)
        differs |= not torch.equal(maps[r.layer][0], plain)
    assert differs

    aligned, rows, _, logits, probs = replay_random_routes(built, batch, 30)
    for j, r in enumerate(built.routers):
        ids = aligned.indices[j][rows].long()
        expected = torch.softmax(logits[r.layer][0][rows], dim=-1).gather(1, ids) * 1.5
        torch.testing.assert_close(probs[r.layer][rows].gather(1, ids), expected)


def test_tensor_parallelism_without_sp_is_refused(family_model_dir, pg_collection):
    with pytest.raises(UnsupportedConfig, match="needs sequence parallelism"):
        build_model(
            family_model_dir("deepseek_v2"),
            routing_replay=True,
            pg_collection=pg_collection,
            tensor_model_parallel_size=2,
        )
