"""gpt-oss: attention sinks, sliding-window attention on every other layer, YaRN rope, biases on
every linear layer, a router with a bias and a softmax over the top-k logits, and a clamped
SwiGLU (``(clamp(up, +-7) + 1) * g * sigmoid(1.702 g)`` with ``g = min(gate, 7)``) in experts
stored fused, gate and up columns interleaved."""

from __future__ import annotations

from typing import Any

from routereplay.families.base import (
    COMMON_KEYS,
    Family,
    MoESize,
    UnsupportedConfig,
    WeightNames,
    every_layer_moe,
    tiny_common,
)

# transformers' and vLLM's gpt-oss experts hard-code these (alpha 1.702 is quick_gelu's).
SWIGLU_LIMIT = 7.0
# The tiny model's window: shorter than the tests' samples, so it binds.
TINY_SLIDING_WINDOW = 8


def megatron_fields(config: dict[str, Any]) -> dict[str, Any]:
    return dict(
        qk_layernorm=False,
        add_qkv_bias=True,
        # o_proj, router and both expert projections carry a bias.
        add_bias_linear=True,
        moe_ffn_hidden_size=int(config["intermediate_size"]),
        moe_router_score_function="softmax",
        moe_router_pre_softmax=False,  # softmax over the top-k logits (router bias included)
        # Sinks: one learned logit per head joins every softmax and is dropped after it.
        softmax_type="learnable",
        # transformers' sliding_window W lets a query see itself and the W - 1 tokens before
        # it; megatron's window (left, right) counts the tokens besides the query.
        window_size=(int(config["sliding_window"]) - 1, 0),
        # megatron windows the layers whose 1-based number is odd: 0-based 0, 2, 4, ...
        window_attn_skip_freq=2,
        # The clamped SwiGLU: glu(gate) * (up + 1), gate clamped above, up both ways.
        glu_linear_offset=1.0,
        activation_func_clamp_value=SWIGLU_LIMIT,
        # megatron asserts it with MoE biases; the layouts use expert TP 1 anyway.
        expert_tensor_parallel_size=1,
    )


def layer_types(num_layers: int) -> list[str]:
    """gpt-oss's attention pattern: sliding on even layers, full on odd ones (what vLLM
    computes whatever ``layer_types`` says, and megatron's ``window_attn_skip_freq=2``)."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


def _refuse(config: dict[str, Any]) -> None:
    given = config.get("layer_types")
    if given is not None and list(given) != layer_types(int(config["num_hidden_layers"])):
        raise UnsupportedConfig(
            f"layer_types {given}: only gpt-oss's alternation (sliding on even layers, full on "
            "odd ones) is mapped; vLLM ignores layer_types and computes that alternation"
        )
    if config.get("sliding_window") is None:
        raise UnsupportedConfig("sliding_window: gpt-oss's windowed layers need a window")
    if not config.get("attention_bias", True):
        raise UnsupportedConfig(
            "attention_bias=False: megatron's add_bias_linear gives o_proj a bias whenever the "
            "router and experts have theirs"
        )
    if float(config.get("swiglu_limit", SWIGLU_LIMIT)) != SWIGLU_LIMIT:
        raise UnsupportedConfig(
            f"swiglu_limit {config['swiglu_limit']}: transformers and vLLM clamp at {SWIGLU_LIMIT}"
        )
    per_token = config.get("experts_per_token")
    if per_token is not None and int(per_token) != int(config["num_experts_per_tok"]):
        raise UnsupportedConfig("experts_per_token differs from num_experts_per_tok")
    if config.get("quantization_config"):
        raise UnsupportedConfig(
            "quantization_config: dequantize MXFP4 checkpoints first (transformers' "
            "Mxfp4Config(dequantize=True), then save_pretrained); see docs/trainer.md"
        )


def tiny_config(size: MoESize, token_ids: dict[str, int]):
    """Every layer MoE (8 experts, top-2), windowed attention on layers 0 and 2, YaRN rope
    (gpt-oss's factor 32), qkv/o/router/expert biases, sinks."""
    import transformers

    return transformers.GptOssConfig(
        **tiny_common(size, token_ids),
        intermediate_size=size.moe_intermediate_size,
        num_local_experts=size.num_experts,
        sliding_window=TINY_SLIDING_WINDOW,
        layer_types=layer_types(size.num_hidden_layers),
        attention_bias=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 150000.0,
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
    )


def tiny_init(model) -> None:
    """Spread the tiny model's weights so that what gpt-oss adds matters: router bias std 0.5
    (it changes choices), sinks std 1 rounded to bfloat16 values (as real checkpoints store
    them: vLLM's CPU kernel reads sinks in bfloat16), expert weights std 0.2 (the SwiGLU
    clamp is active on a share of the values) and biases std 0.05."""
    import torch

    for layer in model.model.layers:
        layer.mlp.router.bias.normal_(0.0, 0.5)
        sinks = layer.self_attn.sinks
        sinks.copy_(torch.randn_like(sinks).bfloat16().float())
        experts = layer.mlp.experts
        experts.gate_up_proj.normal_(0.0, 0.2)
        experts.down_proj.normal_(0.0, 0.2)
        experts.gate_up_proj_bias.normal_(0.0, 0.05)
        experts.down_proj_bias.normal_(0.0, 0.05)


FAMILY = Family(
    model_type="gpt_oss",
    moe_layers=lambda config: every_layer_moe(config, "num_local_experts"),
    config_keys=COMMON_KEYS
    | {
        "attention_bias",
        "layer_types",
        "sliding_window",
        "num_local_experts",
        # Keys of the released checkpoints' config.json.
        "swiglu_limit",
        "experts_per_token",
        "initial_context_length",
        "quantization_config",
    },
    megatron_fields=megatron_fields,
    weights=WeightNames("mlp.", router="router", fused_experts=True),
    tiny_config=tiny_config,
    # head_dim 64 and experts 128 wide: the sizes vLLM's CPU build was measured to serve.
    tiny_size=MoESize(head_dim=64, moe_intermediate_size=128),
    refuse=_refuse,
    activation="quick_gelu",
    rope_types=frozenset({"default", "yarn"}),
    sliding_window=True,
    tiny_init=tiny_init,
)
