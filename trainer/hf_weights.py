"""Qwen3-MoE weights between the Hugging Face layout and megatron-core's local layer spec.

A small explicit mapping, one name table read both ways. (mbridge, the maintained converter,
cannot run on the CPU: it hard-codes TransformerEngine specs and parameter names and calls
``.cuda()``.)

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


def _renamed(config: dict[str, Any]) -> list[tuple[str, str]]:
    """(megatron name, Hugging Face name) of every tensor that maps one to one."""
    pairs = [
        ("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        ("decoder.final_layernorm.weight", "model.norm.weight"),
    ]
    if not config.get("tie_word_embeddings", False):
        pairs.append(("output_layer.weight", "lm_head.weight"))
    for layer, is_moe in enumerate(moe_layer_pattern(config)):
        mg, hf = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        pairs += [
            (mg + "input_layernorm.weight", hf + "input_layernorm.weight"),
            (mg + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight"),
            (mg + "self_attention.q_layernorm.weight", hf + "self_attn.q_norm.weight"),
            (mg + "self_attention.k_layernorm.weight", hf + "self_attn.k_norm.weight"),
            (mg + "self_attention.linear_proj.weight", hf + "self_attn.o_proj.weight"),
        ]
        if is_moe:
            pairs.append((mg + "mlp.router.weight", hf + "mlp.gate.weight"))
    pairs += [(mg + "linear_fc2.weight", hf + "down_proj.weight") for mg, hf in _mlps(config)]
    return pairs


def _mlps(config: dict[str, Any]) -> list[tuple[str, str]]:
    """(megatron prefix, Hugging Face prefix) of every MLP: the dense ones and each expert."""
    prefixes = []
    for layer, is_moe in enumerate(moe_layer_pattern(config)):
        mg, hf = f"decoder.layers.{layer}.mlp.", f"model.layers.{layer}.mlp."
        if is_moe:
            # Checkpoints store experts one by one on disk.
            prefixes += [(f"{mg}experts.local_experts.{e}.", f"{hf}experts.{e}.")
                         for e in range(num_experts(config))]  # fmt: skip
        else:
            prefixes.append((mg, hf))
    return prefixes


def _layers(config: dict[str, Any]) -> list[tuple[str, str]]:
    return [(f"decoder.layers.{i}.", f"model.layers.{i}.")
            for i in range(len(moe_layer_pattern(config)))]  # fmt: skip


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
    out = {mg: hf[name] for mg, name in _renamed(config)}
    for mg, name in _layers(config):
        attn = name + "self_attn."
        out[mg + "self_attention.linear_qkv.weight"] = _qkv_to_megatron(
            hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"],
            config,
        )  # fmt: skip
    for mg, name in _mlps(config):
        # Megatron's gated linear unit splits fc1's rows as [gate; up].
        out[mg + "linear_fc1.weight"] = torch.cat(
            [hf[name + "gate_proj.weight"], hf[name + "up_proj.weight"]], dim=0
        )
    return out


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
    out = {hf: mg[name] for name, hf in _renamed(config)}
    for name, hf in _layers(config):
        q, k, v = _qkv_to_hf(mg[name + "self_attention.linear_qkv.weight"], config)
        attn = hf + "self_attn."
        out[attn + "q_proj.weight"], out[attn + "k_proj.weight"] = q, k
        out[attn + "v_proj.weight"] = v
    for name, hf in _mlps(config):
        gate, up = mg[name + "linear_fc1.weight"].chunk(2, dim=0)
        out[hf + "gate_proj.weight"], out[hf + "up_proj.weight"] = gate, up
    return {name: t.detach().contiguous() for name, t in out.items()}
