"""Qwen3-MoE weights between the Hugging Face layout and megatron-core's local layer spec.

A small explicit mapping, both ways. (mbridge, the maintained converter, cannot run on the CPU:
it hard-codes TransformerEngine specs and parameter names and calls ``.cuda()``.)

Names per decoder layer ``L`` (megatron left, Hugging Face right, ``model.layers.L.`` omitted):

- ``input_layernorm`` = ``input_layernorm``; ``pre_mlp_layernorm`` = ``post_attention_layernorm``
- ``self_attention.linear_qkv`` = q/k/v projections interleaved by query group: for each group
  in turn, its query heads, then its key head, then its value head
- ``self_attention.q_layernorm`` / ``k_layernorm`` = ``self_attn.q_norm`` / ``k_norm``
- ``self_attention.linear_proj`` = ``self_attn.o_proj``
- dense layer: ``mlp.linear_fc1`` = gate rows then up rows; ``mlp.linear_fc2`` = ``down_proj``
- MoE layer: ``mlp.router`` = ``mlp.gate``; ``mlp.experts.local_experts.E.linear_fc1/fc2`` as
  the dense MLP, from ``mlp.experts.E.*`` (checkpoints store experts one by one on disk)

Outside the layers: ``embedding.word_embeddings`` = ``model.embed_tokens``,
``decoder.final_layernorm`` = ``model.norm``, ``output_layer`` = ``lm_head`` (absent when tied).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from trainer.hf_config import moe_layer_pattern, num_experts


def load_hf_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a local safetensors checkpoint (one file or an indexed set of shards)."""
    from safetensors.torch import load_file

    folder = Path(model_dir)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state: dict[str, torch.Tensor] = {}
    for name in files:
        state.update(load_file(str(folder / name)))
    return state


def _heads(config: dict[str, Any]) -> tuple[int, int, int]:
    heads = int(config["num_attention_heads"])
    groups = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return heads, groups, head_dim


def _qkv_to_megatron(q, k, v, config) -> torch.Tensor:
    """``[heads*d, H]``, ``[groups*d, H]`` x2 -> ``[(heads + 2*groups)*d, H]`` grouped rows."""
    heads, groups, d = _heads(config)
    hidden = q.shape[1]
    q = q.view(groups, heads // groups * d, hidden)
    k = k.view(groups, d, hidden)
    v = v.view(groups, d, hidden)
    return torch.cat([q, k, v], dim=1).reshape(-1, hidden)


def _qkv_to_hf(qkv, config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    heads, groups, d = _heads(config)
    per_group = heads // groups * d
    grouped = qkv.view(groups, per_group + 2 * d, qkv.shape[1])
    q, k, v = grouped.split([per_group, d, d], dim=1)
    return (q.reshape(-1, qkv.shape[1]), k.reshape(-1, qkv.shape[1]), v.reshape(-1, qkv.shape[1]))


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor], config: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """Map a Hugging Face Qwen3-MoE state dict to megatron ``GPTModel`` parameter names.

    Args:
        hf: Hugging Face tensors by name (as ``load_hf_state_dict`` returns them).
        config: The parsed ``config.json``.

    Returns:
        Megatron tensors by name, for ``GPTModel.load_state_dict(strict=True)`` (which also
        catches anything this mapping forgot).
    """
    out: dict[str, torch.Tensor] = {
        "embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    if not config.get("tie_word_embeddings", False):
        out["output_layer.weight"] = hf["lm_head.weight"]
    for layer, is_moe in enumerate(moe_layer_pattern(config)):
        src, dst = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        attn = src + "self_attn."
        out[dst + "input_layernorm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "pre_mlp_layernorm.weight"] = hf[src + "post_attention_layernorm.weight"]
        out[dst + "self_attention.linear_qkv.weight"] = _qkv_to_megatron(
            hf[attn + "q_proj.weight"],
            hf[attn + "k_proj.weight"],
            hf[attn + "v_proj.weight"],
            config,
        )
        out[dst + "self_attention.q_layernorm.weight"] = hf[attn + "q_norm.weight"]
        out[dst + "self_attention.k_layernorm.weight"] = hf[attn + "k_norm.weight"]
        out[dst + "self_attention.linear_proj.weight"] = hf[attn + "o_proj.weight"]
        if is_moe:
            out[dst + "mlp.router.weight"] = hf[src + "mlp.gate.weight"]
            for e in range(num_experts(config)):
                expert = f"{dst}mlp.experts.local_experts.{e}."
                _mlp_to_megatron(hf, f"{src}mlp.experts.{e}.", expert, out)
        else:
            _mlp_to_megatron(hf, src + "mlp.", dst + "mlp.", out)
    return out


def _mlp_to_megatron(hf, src: str, dst: str, out: dict[str, torch.Tensor]) -> None:
    # Megatron's gated linear unit splits fc1's rows as [gate; up].
    out[dst + "linear_fc1.weight"] = torch.cat(
        [hf[src + "gate_proj.weight"], hf[src + "up_proj.weight"]], dim=0
    )
    out[dst + "linear_fc2.weight"] = hf[src + "down_proj.weight"]


def megatron_to_hf(
    mg: Mapping[str, torch.Tensor], config: dict[str, Any]
) -> dict[str, torch.Tensor]:
    """The inverse of ``hf_to_megatron``: megatron parameters to Hugging Face names.

    Args:
        mg: Megatron tensors by name (``GPTModel.state_dict()``; extra entries such as
            ``_extra_state`` are ignored).
        config: The parsed ``config.json`` of the checkpoint the model was built from.

    Returns:
        Hugging Face tensors by name, contiguous, ready for ``safetensors.torch.save_file``.
    """
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": mg["embedding.word_embeddings.weight"],
        "model.norm.weight": mg["decoder.final_layernorm.weight"],
    }
    if not config.get("tie_word_embeddings", False):
        out["lm_head.weight"] = mg["output_layer.weight"]
    for layer, is_moe in enumerate(moe_layer_pattern(config)):
        src, dst = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        attn = dst + "self_attn."
        out[dst + "input_layernorm.weight"] = mg[src + "input_layernorm.weight"]
        out[dst + "post_attention_layernorm.weight"] = mg[src + "pre_mlp_layernorm.weight"]
        q, k, v = _qkv_to_hf(mg[src + "self_attention.linear_qkv.weight"], config)
        out[attn + "q_proj.weight"], out[attn + "k_proj.weight"] = q, k
        out[attn + "v_proj.weight"] = v
        out[attn + "q_norm.weight"] = mg[src + "self_attention.q_layernorm.weight"]
        out[attn + "k_norm.weight"] = mg[src + "self_attention.k_layernorm.weight"]
        out[attn + "o_proj.weight"] = mg[src + "self_attention.linear_proj.weight"]
        if is_moe:
            out[dst + "mlp.gate.weight"] = mg[src + "mlp.router.weight"]
            for e in range(num_experts(config)):
                expert = f"{src}mlp.experts.local_experts.{e}."
                _mlp_to_hf(mg, expert, f"{dst}mlp.experts.{e}.", out)
        else:
            _mlp_to_hf(mg, src + "mlp.", dst + "mlp.", out)
    return {name: t.detach().contiguous() for name, t in out.items()}


def _mlp_to_hf(mg, src: str, dst: str, out: dict[str, torch.Tensor]) -> None:
    gate, up = mg[src + "linear_fc1.weight"].chunk(2, dim=0)
    out[dst + "gate_proj.weight"], out[dst + "up_proj.weight"] = gate, up
    out[dst + "down_proj.weight"] = mg[src + "linear_fc2.weight"]
