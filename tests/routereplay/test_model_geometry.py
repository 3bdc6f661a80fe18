"""MoE geometry from config.json, checked against the models themselves.

The oracle instantiates each tiny transformers model (random init) and lists
the decoder layers whose MLP has a router (``gate``) and ``experts``.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from routereplay.domain.record import Geometry
from routereplay.families import SUPPORTED_MODEL_TYPES
from routereplay.families.model_geometry import (
    MoEGeometry,
    geometry_from_config,
    load_geometry,
)

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

# Small shared sizes: fast to build, valid for every family.
SMALL = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
)


def qwen3_moe(**kw):
    args = dict(
        SMALL, num_hidden_layers=6, moe_intermediate_size=16, num_experts=8, num_experts_per_tok=2
    )
    return transformers.Qwen3MoeConfig(**{**args, **kw})


def qwen2_moe(**kw):
    args = dict(
        SMALL,
        num_hidden_layers=6,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        num_experts=6,
        num_experts_per_tok=2,
    )
    return transformers.Qwen2MoeConfig(**{**args, **kw})


def mixtral(**kw):
    args = dict(SMALL, num_hidden_layers=3, num_local_experts=4, num_experts_per_tok=2)
    return transformers.MixtralConfig(**{**args, **kw})


def deepseek_v3(**kw):
    args = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        kv_lora_rank=16,
        q_lora_rank=24,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        first_k_dense_replace=2,
        num_nextn_predict_layers=1,
    )
    return transformers.DeepseekV3Config(**{**args, **kw})


def glm4_moe(**kw):
    args = dict(
        SMALL,
        num_hidden_layers=4,
        moe_intermediate_size=16,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        num_nextn_predict_layers=1,  # as every GLM-4.5 and GLM-4.5-Air release
    )
    return transformers.Glm4MoeConfig(**{**args, **kw})


def gpt_oss(**kw):
    args = dict(
        SMALL, num_hidden_layers=4, num_local_experts=8, num_experts_per_tok=2, sliding_window=8
    )
    return transformers.GptOssConfig(**{**args, **kw})


def deepseek_v2(**kw):
    args = dict(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        kv_lora_rank=16,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        first_k_dense_replace=1,
    )
    return transformers.DeepseekV2Config(**{**args, **kw})


CASES = {
    "qwen3_moe": qwen3_moe(),
    "qwen3_moe_dense0": qwen3_moe(mlp_only_layers=[0, 3]),
    "qwen3_moe_step2": qwen3_moe(decoder_sparse_step=2),
    "qwen3_moe_step2_dense": qwen3_moe(decoder_sparse_step=2, mlp_only_layers=[3]),
    "qwen2_moe": qwen2_moe(),
    "qwen2_moe_dense": qwen2_moe(mlp_only_layers=[1], decoder_sparse_step=1),
    "qwen2_moe_step3": qwen2_moe(decoder_sparse_step=3),
    "mixtral": mixtral(),
    "deepseek_v3": deepseek_v3(),
    "deepseek_v3_k0": deepseek_v3(first_k_dense_replace=0),
    "deepseek_v2": deepseek_v2(),
    "glm4_moe": glm4_moe(),
    "glm4_moe_k2": glm4_moe(first_k_dense_replace=2),
    "gpt_oss": gpt_oss(),
}


def oracle(config) -> tuple[list[int], set[int]]:
    """Instantiate the model; return its router layers and their expert counts.

    A decoder layer is MoE when its MLP carries a router (``gate``; gpt-oss ``router``) and
    ``experts``; the expert count is the router weight's row count.
    """
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    layers, counts = [], set()
    for i, layer in enumerate(model.model.layers):
        router = getattr(layer.mlp, "gate", None) or getattr(layer.mlp, "router", None)
        if router is not None and hasattr(layer.mlp, "experts"):
            layers.append(i)
            counts.add(router.weight.shape[0])
    return layers, counts


@pytest.mark.parametrize("name", sorted(CASES))
def test_moe_layers_match_instantiated_model(name, tmp_path):
    config = CASES[name]
    # Through save_pretrained, as a served checkpoint would be read.
    config.save_pretrained(tmp_path)
    geom = load_geometry(tmp_path, model_id=name)
    expected, counts = oracle(config)
    assert expected, "test case must have MoE layers"
    assert geom.record.moe_layers == tuple(expected)
    assert counts == {geom.record.num_experts}
    assert geom.num_hidden_layers == config.num_hidden_layers
    assert geom.record.topk == config.num_experts_per_tok
    assert geom.record.model_id == name
    # The in-memory dict reads the same.
    assert geometry_from_config(config.to_dict(), name) == geom


def test_qwen3_expert_count_key_variants():
    # transformers 5.17 writes num_local_experts; older checkpoints num_experts.
    base = qwen3_moe(mlp_only_layers=[0]).to_dict()
    n = base.pop("num_local_experts", None) or base.pop("num_experts")
    base.pop("num_experts", None)
    for key in ("num_experts", "num_local_experts"):
        geom = geometry_from_config({**base, key: n}, "m")
        assert geom.record.num_experts == 8
        assert geom.record.moe_layers == (1, 2, 3, 4, 5)


def test_deepseek_mtp_layers_excluded_and_freq():
    config = deepseek_v3(num_nextn_predict_layers=2).to_dict()
    geom = geometry_from_config(config, "dsv3")
    assert geom.record.moe_layers == (2, 3, 4)
    assert max(geom.record.moe_layers) < geom.num_hidden_layers
    # vLLM's rule for moe_layer_freq (transformers' DeepseekV3 has no such field).
    geom2 = geometry_from_config({**config, "moe_layer_freq": 2}, "dsv3")
    assert geom2.record.moe_layers == (2, 4)
    # Kimi-K2 is DeepSeek-V3's architecture under its own model_type.
    assert geometry_from_config({**config, "model_type": "kimi_k2"}, "dsv3") == geom


def test_glm_mtp_layer_excluded():
    # GLM-4.5's MTP layer (model.layers.4 here) is an MoE layer too, but no decoder layer.
    config = glm4_moe().to_dict()
    assert config["num_nextn_predict_layers"] == 1
    geom = geometry_from_config(config, "glm")
    assert geom.record.moe_layers == (1, 2, 3)
    assert geom.num_hidden_layers == 4


def test_geometry_is_the_stored_geometry():
    g = geometry_from_config(qwen3_moe(mlp_only_layers=[0], num_experts=257).to_dict(), "m")
    assert isinstance(g, MoEGeometry) and isinstance(g.record, Geometry)
    assert g.record.dtype == np.uint16 and g.record.num_moe_layers == 5
    assert geometry_from_config(qwen3_moe().to_dict(), "m").record.dtype == np.uint8


def test_unknown_model_type_names_supported():
    with pytest.raises(ValueError) as err:
        geometry_from_config({"model_type": "llama", "num_hidden_layers": 2}, "m")
    for name in SUPPORTED_MODEL_TYPES:
        assert name in str(err.value)


def test_geometry_is_frozen():
    g = geometry_from_config(json.loads(mixtral().to_json_string()), "m")
    with pytest.raises(AttributeError):
        g.num_hidden_layers = 3  # type: ignore[misc]


# The tiny test model (routereplay.dev.tiny_model): geometry and determinism.


def _hashes(folder) -> dict[str, str]:
    import hashlib

    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}


def test_tiny_model_geometry_and_determinism(tiny_model_dir, tmp_path):
    from routereplay.dev.tiny_model import VOCAB_SIZE, main

    geom = load_geometry(tiny_model_dir)
    assert geom.record.moe_layers == (1, 2, 3)
    assert (geom.num_hidden_layers, geom.record.topk, geom.record.num_experts) == (4, 2, 8)
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model_dir)
    assert tok.eos_token is not None and len(tok) <= VOCAB_SIZE
    assert tok.decode(tok.encode("Router replay, ünïcode!")) == "Router replay, ünïcode!"

    files = _hashes(tiny_model_dir)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    main([str(tmp_path / "same")])  # the command-line entry, same seed
    assert _hashes(tmp_path / "same") == files
    main([str(tmp_path / "other"), "--seed", "1"])
    other = _hashes(tmp_path / "other")
    assert other["model.safetensors"] != files["model.safetensors"]
    assert other["tokenizer.json"] == files["tokenizer.json"]


@pytest.mark.parametrize(
    ("family", "moe_layers", "topk", "num_experts"),
    [
        ("qwen2_moe", (1, 2, 3), 2, 8),
        ("mixtral", (0, 1, 2, 3), 2, 8),
        ("glm4_moe", (1, 2, 3), 4, 16),
        ("gpt_oss", (0, 1, 2, 3), 2, 8),
    ],
)
def test_tiny_model_families(family, moe_layers, topk, num_experts, tmp_path):
    from routereplay.dev.tiny_model import main

    main([str(tmp_path / "a"), "--family", family])
    geom = load_geometry(tmp_path / "a")
    assert geom.record.moe_layers == moe_layers
    assert (geom.record.topk, geom.record.num_experts) == (topk, num_experts)
    assert json.loads((tmp_path / "a" / "config.json").read_text())["model_type"] == family
    main([str(tmp_path / "b"), "--family", family])
    assert _hashes(tmp_path / "a") == _hashes(tmp_path / "b")
