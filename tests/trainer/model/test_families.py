"""Every MoE family of ``routereplay.dev.tiny_model`` under replay (float32, CPU, one rank).

Parity with transformers and the weight round trip are in test_model_parity.py. Here:
replaying the natural routes is bit-identical to no replay (it is not if replay combines the
replayed ids with GLM-4.5's biased selection scores, or drops the scaling factor or the group
limit); R2 replays what it recorded after optimizer steps moved natural routing; forced routes
are followed and weighted by the unbiased scores; the expert bias moves with the replayed
routes' counts; unknown checkpoints are refused before anything is built.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")

from tests.conftest import OTHER_FAMILIES
from tests.support.replay import recording
from tests.trainer.helpers import (
    capture_routing,
    grads,
    make_record,
    next_token_loss,
    one_hot,
    random_batch,
    random_routes,
    record_natural_routes,
    replay_random_routes,
)
from trainer.layout.align import align_routes, routes_from_recorded
from trainer.layout.batch import PaddedBatch
from trainer.model.build import build_model
from trainer.model.hf_config import UnsupportedConfig, check_config, read_hf_config
from trainer.optim import AdamW
from trainer.rl.schedule import Schedule


def _records(batch, routes, geometry):
    return [
        make_record(batch.sample_ids[b], batch.sample_tokens(b).numpy(), routes[b], geometry)
        for b in range(batch.batch_size)
    ]


def _train_pass(built, batch, indices=None):
    """One forward + backward from zero grads; replays ``indices`` when given."""
    built.model.zero_grad(set_to_none=True)
    control = built.replay
    with control.step():
        if indices is None:
            loss = next_token_loss(built.model, batch)
            loss.backward()
        else:
            with control.forward(indices):
                loss = next_token_loss(built.model, batch)
            with control.backward():
                loss.backward()
    return loss.detach(), grads(built.model)


@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_replaying_natural_routes_is_bit_identical_to_disabled(
    family, family_model_dir, pg_collection
):
    built = build_model(family_model_dir(family), routing_replay=True, pg_collection=pg_collection)
    batch = random_batch(1, [9, 4, 12], "left")
    loss_off, grads_off = _train_pass(built, batch)
    recorded: list[list[torch.Tensor]] = []
    with torch.no_grad(), built.replay.step(), recording(built.replay, recorded):
        next_token_loss(built.model, batch)
    routes = routes_from_recorded(batch, recorded[0], built.geometry)
    aligned = align_routes(
        batch, _records(batch, routes, built.geometry), built.geometry, built.replay.layers
    )
    loss_on, grads_on = _train_pass(built, batch, aligned.indices)
    assert torch.equal(loss_on, loss_off)
    assert grads_on.keys() == grads_off.keys()
    for name, g in grads_off.items():
        assert torch.equal(grads_on[name], g), name


@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_r2_update_passes_after_optimizer_steps_replay_the_recorded_routes(
    family, family_model_dir, pg_collection
):
    """R2: the routes recorded in the old-logprob pass are the ones every update pass uses,
    though the optimizer steps between them (the project's AdamW, which also moves GLM-4.5's
    expert bias) moved the natural routing away from them."""
    built = build_model(family_model_dir(family), routing_replay=True, pg_collection=pg_collection)
    micro_batches = [random_batch(21, [8, 6], "left"), random_batch(22, [5, 9], "left")]
    _, records = record_natural_routes(built, micro_batches, next_token_loss)
    by_id = {r.sample_id: r for r in records}
    optimizer = AdamW(built.model, lr=0.05)  # large, so natural routing really moves
    biases = [r.expert_bias.clone() for r in optimizer.biased_routers]
    for batch in micro_batches:
        aligned = align_routes(
            batch, [by_id[s] for s in batch.sample_ids], built.geometry, built.replay.layers
        )
        built.model.zero_grad(set_to_none=True)
        with built.replay.step(), capture_routing(built.routers) as (maps, _):
            with built.replay.forward(aligned.indices):
                loss = next_token_loss(built.model, batch)
            with built.replay.backward():
                loss.backward()
        optimizer.step()
        rows = aligned.replayed.reshape(-1)
        for j, layer in enumerate(built.replay.layers):
            recorded = one_hot(aligned.indices[j][rows].long(), built.geometry.num_experts)
            assert torch.equal(maps[layer][0][rows], recorded), f"layer {layer}"
    # The routers' own choice after the steps (their natural routing, bias and group limit
    # included) differs from the recorded routes: otherwise the test proves nothing.
    _, after = record_natural_routes(built, micro_batches, next_token_loss)
    changed = sum(
        int((np.sort(a.routes, -1) != np.sort(by_id[a.sample_id].routes, -1)).any(-1).sum())
        for a in after
    )
    assert changed > 0, "the optimizer steps did not move natural routing"
    for router, old in zip(optimizer.biased_routers, biases, strict=True):
        assert not torch.equal(router.expert_bias, old)


@pytest.fixture(scope="module")
def glm(family_model_dir, pg_collection):
    return build_model(
        family_model_dir("glm4_moe"), routing_replay=True, pg_collection=pg_collection
    )


def test_glm_router_uses_bias_and_group_limit(glm):
    """The tiny GLM-4.5 exercises what replay could get wrong: on some tokens the natural
    choice differs from the plain top-k of the unbiased scores and from the top-k of the biased
    scores without the group limit (else the replay tests below could not fail)."""
    geometry = glm.geometry
    batch = random_batch(5, [16, 16], "right")
    with torch.no_grad(), capture_routing(glm.routers) as (maps, logits):
        next_token_loss(glm.model, batch)
    unbiased_differs = ungrouped_differs = False
    for r in glm.routers:
        scores = torch.sigmoid(logits[r.layer][0])
        plain = one_hot(scores.topk(geometry.topk, dim=-1).indices, geometry.num_experts)
        biased = scores + r.router.expert_bias
        ungrouped = one_hot(biased.topk(geometry.topk, dim=-1).indices, geometry.num_experts)
        unbiased_differs |= not torch.equal(maps[r.layer][0], plain)
        ungrouped_differs |= not torch.equal(maps[r.layer][0], ungrouped)
    assert unbiased_differs and ungrouped_differs


def test_glm_forced_routes_are_weighted_by_unbiased_scaled_scores(glm):
    geometry, config = glm.geometry, glm.model.config
    batch = random_batch(2, [10, 6, 8], "right")
    # Random routes ignore the group limit: replay must follow them anyway.
    aligned, rows, maps, logits, probs = replay_random_routes(glm, batch, 100)
    scale = config.moe_router_topk_scaling_factor
    assert scale == 2.5
    for j, r in enumerate(glm.routers):
        ids = aligned.indices[j][rows].long()
        assert torch.equal(maps[r.layer][0][rows], one_hot(ids, geometry.num_experts))
        chosen = torch.sigmoid(logits[r.layer][0][rows]).gather(1, ids)
        expected = chosen / chosen.sum(-1, keepdim=True) * scale
        torch.testing.assert_close(probs[r.layer][rows].gather(1, ids), expected)


def test_expert_bias_moves_with_the_replayed_routes(family_model_dir, pg_collection):
    built = build_model(
        family_model_dir("glm4_moe"), routing_replay=True, pg_collection=pg_collection
    )
    geometry = built.geometry
    optimizer = AdamW(built.model, lr=0.0)
    assert len(optimizer.biased_routers) == geometry.num_moe_layers
    batch = random_batch(3, [12, 9], "right")
    routes = [random_routes(7 + b, int(n) - 1, geometry) for b, n in enumerate(batch.lengths)]
    aligned = align_routes(batch, _records(batch, routes, geometry), geometry, built.replay.layers)
    before = [r.router.expert_bias.clone() for r in built.routers]
    with capture_routing(built.routers) as (maps, _):
        _train_pass(built, batch, aligned.indices)
    rows = aligned.replayed.reshape(-1)
    counts = []
    for j, r in enumerate(built.routers):
        # The counts are the routing map megatron used: the replayed ids on replayed rows.
        used = maps[r.layer][0]
        assert torch.equal(
            used[rows], one_hot(aligned.indices[j][rows].long(), geometry.num_experts)
        )
        counts.append(used.sum(0).float())
        assert torch.equal(r.router.local_tokens_per_expert, counts[-1])
    optimizer.step()
    rate = built.model.config.moe_router_bias_update_rate
    for r, old, n in zip(built.routers, before, counts, strict=True):
        expected = old + torch.sign(n.mean() - n) * rate
        assert torch.equal(r.router.expert_bias, expected)
        assert not torch.equal(r.router.expert_bias, old)
        assert not r.router.local_tokens_per_expert.any()  # the next step counts afresh


def _config(family_model_dir, family, **changes):
    config = read_hf_config(family_model_dir(family))
    config.update(changes)
    return config


@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_unknown_config_key_is_refused_by_name(family, family_model_dir):
    config = _config(family_model_dir, family, some_new_routing_knob=1)
    with pytest.raises(UnsupportedConfig, match="some_new_routing_knob"):
        check_config(config)


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"norm_topk_prob": False}, "norm_topk_prob"),
        ({"topk_group": 1}, "top 2"),
        ({"rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn"}}, "rope scaling"),
    ],
)
def test_glm_settings_megatron_cannot_reproduce_are_refused(family_model_dir, changes, match):
    config = _config(family_model_dir, "glm4_moe", **changes)
    with pytest.raises(UnsupportedConfig, match=match):
        check_config(config)


def test_refused_before_anything_is_built(family_model_dir, tmp_path, pg_collection):
    import shutil

    shutil.copytree(family_model_dir("mixtral"), tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["router_jitter_noise"] = 0.1
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedConfig, match="router_jitter_noise"):
        build_model(tmp_path / "m", routing_replay=True, pg_collection=pg_collection)


def test_partial_rotary_reaches_megatron(glm):
    # GLM-4.5 rotates half of each head: 16 of 32 channels, 8 frequencies.
    assert glm.checkpoint.raw["rope_parameters"]["partial_rotary_factor"] == 0.5
    assert glm.model.rotary_pos_emb.inv_freq.numel() == glm.model.config.kv_channels // 4


@pytest.mark.parametrize("family", ["mixtral", "glm4_moe"])
def test_reported_natural_choice_is_the_routers_own(family, family_model_dir, pg_collection):
    """The consistency report's natural routing (what ``Replay.observe`` keeps as
    ``"natural"``) equals what the routers chose without replay: GLM-4.5's biased,
    group-limited sigmoid choice, not the logits' top-k (the report showed 2-24% agreement for
    GLM-4.5 before)."""
    built = build_model(family_model_dir(family), routing_replay=True, pg_collection=pg_collection)
    observed: dict[int, dict[str, torch.Tensor]] = {}
    maps: dict[int, torch.Tensor] = {}
    handles = [
        r.router.register_forward_hook(
            lambda m, i, o, layer=r.layer: maps.__setitem__(layer, o[1].detach().clone())
        )
        for r in built.routers
    ]
    try:
        with torch.no_grad(), built.replay.observe(observed):
            next_token_loss(built.model, random_batch(6, [16, 16], "right"))
    finally:
        for h in handles:
            h.remove()
    for r in built.routers:
        ids = observed[r.layer]["natural"]
        assert torch.equal(one_hot(ids, built.geometry.num_experts), maps[r.layer])


def test_padding_leaves_the_aux_loss_alone(tiny_model_dir, pg_collection):
    """With megatron's load-balancing loss turned on (the trainer leaves it off), the padding
    mask keeps padding out of it: per MoE layer it equals the Switch formula over the real
    tokens' router logits alone, for the same samples padded to two lengths."""
    from megatron.core.transformer.moe import moe_utils

    built = build_model(
        tiny_model_dir,
        routing_replay=True,
        pg_collection=pg_collection,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=0.01,
    )
    schedule = Schedule(built)
    samples = random_batch(3, [12, 9], "right")
    tokens = [samples.sample_tokens(b).numpy() for b in range(samples.batch_size)]
    experts, k = built.geometry.num_experts, built.geometry.topk

    def switch_loss(logits: torch.Tensor) -> torch.Tensor:
        """E / (k T^2) * sum_i (tokens routed to i) * (sum of i's probabilities)."""
        probs = torch.softmax(logits.float(), dim=-1)
        counts = one_hot(probs.topk(k, dim=-1).indices, experts).sum(0).float()
        return experts / (k * len(probs) ** 2) * (counts * probs.sum(0)).sum()

    def losses(max_length):
        batch = PaddedBatch.from_samples(
            samples.sample_ids, tokens, pad_id=1, max_length=max_length
        )
        moe_utils.clear_aux_losses_tracker()
        with capture_routing(built.routers) as (_, logits):
            schedule.run([batch], lambda m, out: (out.float().mean(), {}), forward_only=False)
        tracked = moe_utils.get_moe_layer_wise_logging_tracker()["load_balancing_loss"]
        real = batch.valid.T.reshape(-1)  # megatron's token order: [seq, rows]
        got = torch.stack([tracked["values"][r.layer] for r in built.routers])
        want = torch.stack([switch_loss(logits[r.layer][0][real]) for r in built.routers])
        torch.testing.assert_close(got, want, rtol=1e-5, atol=0)
        return got

    torch.testing.assert_close(losses(12), losses(20), rtol=1e-5, atol=0)


def test_padding_leaves_the_expert_bias_counts_alone(family_model_dir, pg_collection):
    """The RL step's schedule hands megatron the padding mask: the same samples padded to two
    lengths count the same tokens per expert (the expert-bias update's input), and those counts
    are the routing maps' sums over the real tokens alone."""
    built = build_model(
        family_model_dir("glm4_moe"), routing_replay=True, pg_collection=pg_collection
    )
    schedule = Schedule(built)
    samples = random_batch(3, [12, 9], "right")
    tokens = [samples.sample_tokens(b).numpy() for b in range(samples.batch_size)]

    def counts(max_length):
        batch = PaddedBatch.from_samples(
            samples.sample_ids, tokens, pad_id=1, max_length=max_length
        )
        for r in built.routers:
            r.router.local_tokens_per_expert.zero_()
        with capture_routing(built.routers) as (maps, _):
            schedule.run([batch], lambda m, logits: (logits.float().mean(), {}), forward_only=False)
        real = batch.valid.T.reshape(-1)  # megatron's token order: [seq, rows]
        for r in built.routers:
            used = maps[r.layer][0][real].sum(0).float()
            assert torch.equal(r.router.local_tokens_per_expert, used)
        return [r.router.local_tokens_per_expert.clone() for r in built.routers]

    for short, long in zip(counts(12), counts(20), strict=True):
        assert torch.equal(short, long)
