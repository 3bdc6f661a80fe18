"""The served checkpoint in megatron-core gives transformers' numbers (float32, CPU).

Tolerance: max |logit difference| <= 1e-5 on every real token (measured 4e-7..1.4e-6 on the
tiny model), argmax equal, and the natural top-k expert set equal to transformers' on 100% of
tokens of every MoE layer, matched by global layer number. transformers runs each sample alone
(no padding); megatron runs the padded batch, so padding must not leak into real tokens either.
Every family of ``routereplay.dev.tiny_model`` runs through the same checks.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

pytest.importorskip("megatron.core")

from routereplay.dev.hf_rollout import hf_routers
from tests.conftest import OTHER_FAMILIES
from tests.trainer.helpers import capture_routing, one_hot, random_batch
from trainer.model.build import build_model
from trainer.model.hf_config import UnsupportedConfig

LOGIT_ATOL = 1e-5


def _variant(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module", params=["norm_topk_prob", "no_norm_topk_prob", *OTHER_FAMILIES])
def model_dir(request, tiny_model_dir, family_model_dir, tmp_path_factory):
    if request.param == "norm_topk_prob":
        return tiny_model_dir
    if request.param in OTHER_FAMILIES:
        return family_model_dir(request.param)
    return _variant(tiny_model_dir, tmp_path_factory.mktemp("v") / "m", norm_topk_prob=False)


def _hf_reference(model_dir, tokens):
    """transformers' logits ``[T, V]`` and top-k ids by global layer, one sample at a time."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    topk: dict[int, torch.Tensor] = {}
    handles = [
        router.register_forward_hook(
            lambda m, i, o, n=n: topk.__setitem__(n, o[2].detach().clone())
        )
        for n, router in hf_routers(hf).items()
    ]
    out = []
    with torch.no_grad():
        for t in tokens:
            topk.clear()
            logits = hf(torch.as_tensor(t)[None]).logits[0]
            out.append((logits, dict(topk)))
    for h in handles:
        h.remove()
    return out


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_logits_and_natural_routing_match_transformers(model_dir, pg_collection, padding_side):
    built = build_model(model_dir, routing_replay=False, pg_collection=pg_collection)
    model = built.model.eval()
    batch = random_batch(7, [11, 5, 8], padding_side)
    tokens = [batch.sample_tokens(b).numpy() for b in range(batch.batch_size)]
    with torch.no_grad(), capture_routing(built.routers) as (maps, _):
        logits = model(batch.token_ids, batch.position_ids(), batch.attention_mask())
    reference = _hf_reference(model_dir, tokens)
    num_experts = built.geometry.num_experts
    assert sorted(reference[0][1]) == list(built.geometry.moe_layers)
    worst = 0.0
    for b, (ref_logits, ref_topk) in enumerate(reference):
        start, n = int(batch.starts[b]), int(batch.lengths[b])
        ours = logits[b, start : start + n]
        worst = max(worst, float((ours - ref_logits).abs().max()))
        assert torch.equal(ours.argmax(-1), ref_logits.argmax(-1))
        for layer, ref_ids in ref_topk.items():
            # megatron's routing map rows are tokens in [seq, batch] order.
            routing = maps[layer][0].view(batch.seq_len, batch.batch_size, -1)[start : start + n, b]
            assert torch.equal(routing, one_hot(ref_ids, num_experts)), f"layer {layer}"
    assert worst <= LOGIT_ATOL, f"max |dlogit| {worst:.2e}"
    print(f"max |dlogit| {worst:.2e} ({padding_side} padding)")


def test_hf_megatron_hf_weights_round_trip_is_bitwise(model_dir, pg_collection):
    from trainer.model.hf_weights import load_hf_state_dict, megatron_to_hf, read_mtp_tensors

    built = build_model(model_dir, routing_replay=False, pg_collection=pg_collection)
    back = megatron_to_hf(built.model.state_dict(), built.checkpoint)
    original = load_hf_state_dict(model_dir)
    # Multi-token-prediction layers (DeepSeek-V3) are no part of the model: all of the rest is.
    mtp = read_mtp_tensors(model_dir, built.checkpoint)
    assert bool(mtp) == bool(built.checkpoint.raw.get("num_nextn_predict_layers"))
    assert sorted(back) == sorted(set(original) - set(mtp))
    for name, tensor in back.items():
        assert torch.equal(original[name], tensor), name


@pytest.mark.parametrize(
    "setting",
    [{"moe_router_fusion": True}, {"moe_router_load_balancing_type": "sinkhorn"}],
)
def test_settings_that_bypass_replay_are_refused(tiny_model_dir, pg_collection, setting):
    with pytest.raises(UnsupportedConfig, match="bypasses router replay"):
        build_model(tiny_model_dir, routing_replay=True, pg_collection=pg_collection, **setting)


def test_building_twice_does_not_double_register(tiny_model_dir, pg_collection):
    from megatron.core.transformer.moe.router_replay import RouterReplay

    for _ in range(2):
        built = build_model(tiny_model_dir, routing_replay=True, pg_collection=pg_collection)
    assert RouterReplay.global_router_replay_instances == [r.replay for r in built.routers]
