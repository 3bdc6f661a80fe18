"""The checkpoint's multi-token-prediction layer (DeepSeek-V3's and GLM-4.5's, float32, CPU, one
rank): never a decoder layer of the trainer's model, refused unless dropped, and carried over
unchanged into exports.

Each tiny model of a family with ``mtp_layers`` has one, ``model.layers.4`` after its 4 decoder
layers: the last decoder layer's tensors plus noise and the MTP layer's own (``enorm``,
``hnorm``, ``eh_proj``, ``shared_head``, ``embed_tokens``), as ``routereplay.dev.tiny_model``
writes it.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from routereplay.families import FAMILIES
from tests.trainer.helpers import (
    capture_routing,
    make_record,
    next_token_loss,
    one_hot,
    random_batch,
    random_routes,
)
from trainer.layout.align import align_routes
from trainer.model.build import build_model
from trainer.model.hf_config import UnsupportedConfig
from trainer.model.hf_weights import load_hf_state_dict

MTP_FAMILIES = tuple(name for name, family in FAMILIES.items() if family.mtp_layers)
# The MTP layer's own tensors beside its decoder-layer ones.
MTP_OWN = {
    "enorm.weight",
    "hnorm.weight",
    "eh_proj.weight",
    "shared_head.norm.weight",
    "shared_head.head.weight",
    "embed_tokens.weight",
}


def test_the_mtp_families():
    assert set(MTP_FAMILIES) == {"deepseek_v3", "glm4_moe"}


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_mtp_layer_is_never_a_decoder_layer(family, family_model_dir, pg_collection):
    """The checkpoint's MTP layer (``model.layers.4``, a full MoE layer with its own router)
    is left out: the model's routers are the decoder's MoE layers 1-3 of the geometry, each
    holding its own layer's router weights and expert bias (not the MTP layer's), and the
    routes replayed for global layer L reach that router. Reading the MTP layer as a decoder
    layer (a shifted layer number, the MTP router aliased to a decoder layer) fails here."""
    model_dir = family_model_dir(family)
    built = build_model(model_dir, routing_replay=True, pg_collection=pg_collection)
    hf = load_hf_state_dict(model_dir)
    config = built.checkpoint.raw
    assert config["num_nextn_predict_layers"] == 1 and config["num_hidden_layers"] == 4
    assert built.geometry.moe_layers == (1, 2, 3)
    assert built.replay.layers == (1, 2, 3)
    assert len(built.model.decoder.layers) == 4
    mtp_gate = hf["model.layers.4.mlp.gate.weight"]
    for r in built.routers:
        own = hf[f"model.layers.{r.layer}.mlp.gate.weight"]
        assert torch.equal(r.router.weight, own), f"layer {r.layer}"
        assert not torch.equal(r.router.weight, mtp_gate)
        bias = hf[f"model.layers.{r.layer}.mlp.gate.e_score_correction_bias"]
        assert torch.equal(r.router.expert_bias, bias)
    # Forced routes per global layer land on that layer's router, none elsewhere.
    geometry = built.geometry
    batch = random_batch(9, [8, 11], "right")
    routes = [random_routes(60 + b, int(n) - 1, geometry) for b, n in enumerate(batch.lengths)]
    records = [
        make_record(batch.sample_ids[b], batch.sample_tokens(b).numpy(), routes[b], geometry)
        for b in range(batch.batch_size)
    ]
    aligned = align_routes(batch, records, geometry, built.replay.layers)
    with torch.no_grad(), built.replay.step(), capture_routing(built.routers) as (maps, _):
        with built.replay.forward(aligned.indices):
            next_token_loss(built.model, batch)
    rows = aligned.replayed.reshape(-1)
    for j, r in enumerate(built.routers):
        want = one_hot(aligned.indices[j][rows].long(), geometry.num_experts)
        assert torch.equal(maps[r.layer][0][rows], want), f"layer {r.layer}"


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_mtp_layers_are_refused_unless_dropped(family, family_model_dir, pg_collection):
    with pytest.raises(UnsupportedConfig, match="drop_mtp_layers"):
        build_model(
            family_model_dir(family),
            routing_replay=True,
            pg_collection=pg_collection,
            drop_mtp_layers=False,
        )


@pytest.mark.parametrize("family", MTP_FAMILIES)
def test_export_carries_the_mtp_layer_over(family, family_model_dir, pg_collection, tmp_path):
    from trainer.model.export import export_hf

    model_dir = family_model_dir(family)
    built = build_model(model_dir, routing_replay=False, pg_collection=pg_collection)
    out = export_hf(built, model_dir, tmp_path / "export")
    source, exported = load_hf_state_dict(model_dir), load_hf_state_dict(out)
    assert sorted(exported) == sorted(source)
    # The whole MTP layer: a decoder layer's tensors (as many as the last one's) and its own.
    last = {n.removeprefix("model.layers.3.") for n in source if n.startswith("model.layers.3.")}
    mtp = {n.removeprefix("model.layers.4.") for n in source if n.startswith("model.layers.4.")}
    assert mtp == last | MTP_OWN
    for name in mtp:
        name = f"model.layers.4.{name}"
        assert torch.equal(exported[name], source[name]), name
