"""MoE weights between the Hugging Face format and megatron-core's local layer spec, per family.

A small explicit mapping read both ways; each family's MoE tensor names come from its module
in ``routereplay.families``. (mbridge, the maintained converter, cannot run on the CPU: it
hard-codes TransformerEngine specs and parameter names and calls ``.cuda()``.)

Names per decoder layer ``L`` (megatron left, Hugging Face right, ``model.layers.L.`` omitted):

- ``input_layernorm`` = ``input_layernorm``; ``pre_mlp_layernorm`` = ``post_attention_layernorm``
- ``self_attention.linear_qkv`` = q/k/v projections interleaved by query group: for each group
  in turn, its query heads, then its key head, then its value head (the bias the same way, where
  the family has one: Qwen2-MoE ``qkv_bias``, GLM-4.5 ``attention_bias``)
- ``self_attention.q_layernorm`` / ``k_layernorm`` = ``self_attn.q_norm`` / ``k_norm`` (Qwen3-MoE;
  GLM-4.5 with ``use_qk_norm``)
- ``self_attention.linear_proj`` = ``self_attn.o_proj``
- latent attention (DeepSeek-V2/V3), under ``self_attention.`` / ``self_attn.``:
  ``linear_q_down_proj`` = ``q_a_proj``, ``q_layernorm`` = ``q_a_layernorm``,
  ``linear_q_up_proj`` = ``q_b_proj`` (with a ``q_lora_rank``; else ``linear_q_proj`` =
  ``q_proj``), ``linear_kv_down_proj`` = ``kv_a_proj_with_mqa``, ``kv_layernorm`` =
  ``kv_a_layernorm``, ``linear_kv_up_proj`` = ``kv_b_proj``; no fused qkv
- dense layer: ``mlp.linear_fc1`` = gate rows then up rows; ``mlp.linear_fc2`` = ``down_proj``
- MoE layer, under the family's MoE block (``mlp.``; Mixtral ``block_sparse_moe.``):
  ``mlp.router`` = ``gate``; ``mlp.experts.local_experts.E.linear_fc1/fc2`` as the dense MLP
  from ``experts.E.*`` (``gate_proj``/``up_proj``/``down_proj``; Mixtral ``w1``/``w3``/``w2``;
  checkpoints store experts one by one on disk)
- shared expert: ``mlp.shared_experts.linear_fc1/fc2`` as the dense MLP from
  ``mlp.shared_expert.*`` (Qwen2-MoE) or ``mlp.shared_experts.*`` (GLM-4.5);
  ``mlp.shared_experts.gate_weight`` = ``mlp.shared_expert_gate.weight`` (Qwen2-MoE)
- expert bias (GLM-4.5): ``mlp.router.expert_bias`` = ``mlp.gate.e_score_correction_bias``
- gpt-oss: the router is ``mlp.router`` (weight and bias); ``self_attention.linear_proj.bias`` =
  ``self_attn.o_proj.bias``; ``self_attention.core_attention.softmax_offset`` (megatron's
  learnable softmax offset) = ``self_attn.sinks``; its experts are stored fused:
  ``mlp.experts.gate_up_proj[E]`` ``[H, 2I]`` (applied as ``x @ W``, gate and up columns
  interleaved) is expert ``E``'s ``linear_fc1.weight`` ``[gate rows; up rows]`` transposed and
  de-interleaved, ``gate_up_proj_bias[E]`` its bias the same way, ``down_proj[E]`` ``[I, H]``
  its ``linear_fc2.weight`` transposed and ``down_proj_bias[E]`` its bias

Outside the layers: ``embedding.word_embeddings`` = ``model.embed_tokens``,
``decoder.final_layernorm`` = ``model.norm``, ``output_layer`` = ``lm_head`` (absent when tied).
Multi-token-prediction layers (``model.layers.{num_hidden_layers + i}``) are no decoder
layers and are not mapped: ``read_mtp_tensors`` reads them so an export can carry them over.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from routereplay.families.base import DENSE_PROJ
from trainer.model.hf_config import CheckpointConfig


def load_hf_state_dict(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a local safetensors checkpoint (one file or an indexed set of shards)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in _weight_files(Path(model_dir)):
        _check_readable(path)
        state.update(load_file(str(path)))
    return state


def _check_readable(path: Path) -> None:
    """Raise what is wrong with ``path`` in words: safetensors reports a file this user may
    not read as "No such file or directory"."""
    try:
        path.open("rb").close()
    except PermissionError as e:
        raise PermissionError(
            f"{path}: permission denied for uid {os.getuid()} (mode "
            f"{path.stat().st_mode & 0o777:o}, owner uid {path.stat().st_uid}); make the "
            "checkpoint readable by this user, e.g. chmod -R a+rX on its folder"
        ) from e


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        names = set(json.loads(index.read_text())["weight_map"].values())
        return [folder / name for name in sorted(names)]
    return [folder / "model.safetensors"]


def _heads(checkpoint: CheckpointConfig) -> tuple[int, int, int]:
    config = checkpoint.raw
    heads = int(config["num_attention_heads"])
    groups = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    return heads, groups, head_dim


def _qkv_to_megatron(q, k, v, checkpoint: CheckpointConfig) -> torch.Tensor:
    """``[heads*d, H]``, ``[groups*d, H]`` x2 -> ``[(heads + 2*groups)*d, H]`` grouped rows
    (biases: the same without the ``H`` dimension)."""
    if q.dim() == 1:
        return _qkv_to_megatron(q[:, None], k[:, None], v[:, None], checkpoint)[:, 0]
    heads, groups, d = _heads(checkpoint)
    hidden = q.shape[1]
    q = q.view(groups, heads // groups * d, hidden)
    k = k.view(groups, d, hidden)
    v = v.view(groups, d, hidden)
    return torch.cat([q, k, v], dim=1).reshape(-1, hidden)


def _qkv_to_hf(
    qkv, checkpoint: CheckpointConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if qkv.dim() == 1:
        q, k, v = _qkv_to_hf(qkv[:, None], checkpoint)
        return q[:, 0], k[:, 0], v[:, 0]
    heads, groups, d = _heads(checkpoint)
    per_group = heads // groups * d
    grouped = qkv.view(groups, per_group + 2 * d, qkv.shape[1])
    q, k, v = grouped.split([per_group, d, d], dim=1)
    return (q.reshape(-1, qkv.shape[1]), k.reshape(-1, qkv.shape[1]), v.reshape(-1, qkv.shape[1]))


def _renamed(checkpoint: CheckpointConfig) -> list[tuple[str, str]]:
    """(megatron name, Hugging Face name) of every tensor that maps one to one."""
    fields, names = checkpoint.fields, checkpoint.family.weights
    pairs = [
        ("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
        ("decoder.final_layernorm.weight", "model.norm.weight"),
    ]
    if not checkpoint.raw.get("tie_word_embeddings", False):
        pairs.append(("output_layer.weight", "lm_head.weight"))
    for layer, is_moe in enumerate(checkpoint.moe_pattern):
        mg, hf = f"decoder.layers.{layer}.", f"model.layers.{layer}."
        pairs += [
            (mg + "input_layernorm.weight", hf + "input_layernorm.weight"),
            (mg + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight"),
            (mg + "self_attention.linear_proj.weight", hf + "self_attn.o_proj.weight"),
        ]
        if fields.get("add_bias_linear"):
            pairs.append((mg + "self_attention.linear_proj.bias", hf + "self_attn.o_proj.bias"))
        if fields.get("softmax_type") == "learnable":
            pairs.append(
                (mg + "self_attention.core_attention.softmax_offset", hf + "self_attn.sinks")
            )
        if fields.get("multi_latent_attention"):
            pairs += _latent_attention(mg + "self_attention.", hf + "self_attn.", fields)
        elif fields["qk_layernorm"]:
            pairs += [
                (mg + "self_attention.q_layernorm.weight", hf + "self_attn.q_norm.weight"),
                (mg + "self_attention.k_layernorm.weight", hf + "self_attn.k_norm.weight"),
            ]
        if is_moe:
            router = f"{hf}{names.moe}{names.router}."
            pairs.append((mg + "mlp.router.weight", router + "weight"))
            if fields.get("add_bias_linear"):
                pairs.append((mg + "mlp.router.bias", router + "bias"))
            if fields.get("moe_router_enable_expert_bias"):
                pairs.append(
                    (mg + "mlp.router.expert_bias", hf + names.moe + "gate.e_score_correction_bias")
                )
            if names.shared_gate is not None:
                pairs.append(
                    (mg + "mlp.shared_experts.gate_weight", hf + names.shared_gate + "weight")
                )
    for mg, hf, (_, _, down) in _mlps(checkpoint):
        pairs.append((mg + "linear_fc2.weight", f"{hf}{down}.weight"))
    return pairs


def _latent_attention(mg: str, hf: str, fields: dict[str, Any]) -> list[tuple[str, str]]:
    """(megatron, Hugging Face) names of one layer's latent-attention tensors. Each maps as
    it is: both sides split the query rows per head into (latent, rotary) and ``kv_b_proj``'s
    rows per head into (key latent, value), and ``kv_a_proj_with_mqa``'s rows into
    (``kv_lora_rank``, the shared rotary key), in the same order."""
    if fields["q_lora_rank"] is None:
        query = [("linear_q_proj", "q_proj")]
    else:
        query = [
            ("linear_q_down_proj", "q_a_proj"),
            ("q_layernorm", "q_a_layernorm"),
            ("linear_q_up_proj", "q_b_proj"),
        ]
    latent = [
        ("linear_kv_down_proj", "kv_a_proj_with_mqa"),
        ("kv_layernorm", "kv_a_layernorm"),
        ("linear_kv_up_proj", "kv_b_proj"),
    ]
    return [(f"{mg}{m}.weight", f"{hf}{h}.weight") for m, h in query + latent]


def _mlps(checkpoint: CheckpointConfig) -> list[tuple[str, str, tuple[str, str, str]]]:
    """(megatron prefix, Hugging Face prefix, HF gate/up/down names) of every MLP: the dense
    ones, each expert and the shared expert."""
    names = checkpoint.family.weights
    shared = "moe_shared_expert_intermediate_size" in checkpoint.fields
    prefixes = []
    for layer, is_moe in enumerate(checkpoint.moe_pattern):
        mg, hf = f"decoder.layers.{layer}.mlp.", f"model.layers.{layer}."
        if is_moe and not names.fused_experts:
            # Checkpoints store experts one by one on disk.
            prefixes += [
                (
                    f"{mg}experts.local_experts.{e}.",
                    f"{hf}{names.moe}experts.{e}.",
                    names.expert_proj,
                )
                for e in range(checkpoint.geometry.num_experts)
            ]
            if shared:
                prefixes.append((f"{mg}shared_experts.", hf + names.shared, DENSE_PROJ))
        elif not is_moe:
            prefixes.append((mg, hf + "mlp.", DENSE_PROJ))
    return prefixes


def _fused_experts(checkpoint: CheckpointConfig) -> list[tuple[str, str]]:
    """(megatron prefix of a layer's experts, Hugging Face prefix of its fused expert tensors)
    for every MoE layer of a family storing its experts fused (gpt-oss); empty otherwise."""
    names = checkpoint.family.weights
    if not names.fused_experts:
        return []
    return [
        (
            f"decoder.layers.{layer}.mlp.experts.local_experts.",
            f"model.layers.{layer}.{names.moe}experts.",
        )
        for layer, is_moe in enumerate(checkpoint.moe_pattern)
        if is_moe
    ]


def _deinterleave(gate_up: torch.Tensor) -> torch.Tensor:
    """``[..., 2I]`` with gate and up interleaved -> ``[gate; up]`` along the last dim."""
    return torch.cat([gate_up[..., ::2], gate_up[..., 1::2]], dim=-1)


def _interleave(fc1: torch.Tensor) -> torch.Tensor:
    """The inverse of ``_deinterleave``."""
    gate, up = fc1.chunk(2, dim=-1)
    return torch.stack([gate, up], dim=-1).flatten(-2)


def _fused_to_megatron(hf, checkpoint: CheckpointConfig, out) -> None:
    for mg, name in _fused_experts(checkpoint):
        gate_up, gate_up_bias = hf[name + "gate_up_proj"], hf[name + "gate_up_proj_bias"]
        down, down_bias = hf[name + "down_proj"], hf[name + "down_proj_bias"]
        for e in range(gate_up.shape[0]):
            out[f"{mg}{e}.linear_fc1.weight"] = _deinterleave(gate_up[e]).T
            out[f"{mg}{e}.linear_fc1.bias"] = _deinterleave(gate_up_bias[e])
            out[f"{mg}{e}.linear_fc2.weight"] = down[e].T
            out[f"{mg}{e}.linear_fc2.bias"] = down_bias[e]


def _fused_to_hf(mg, checkpoint: CheckpointConfig, out) -> None:
    experts = range(checkpoint.geometry.num_experts)
    for name, hf in _fused_experts(checkpoint):
        out[hf + "gate_up_proj"] = torch.stack(
            [_interleave(mg[f"{name}{e}.linear_fc1.weight"].T) for e in experts]
        )
        out[hf + "gate_up_proj_bias"] = torch.stack(
            [_interleave(mg[f"{name}{e}.linear_fc1.bias"]) for e in experts]
        )
        fc2 = [f"{name}{e}.linear_fc2." for e in experts]
        out[hf + "down_proj"] = torch.stack([mg[n + "weight"].T for n in fc2])
        out[hf + "down_proj_bias"] = torch.stack([mg[n + "bias"] for n in fc2])


def _layers(checkpoint: CheckpointConfig) -> list[tuple[str, str]]:
    return [
        (f"decoder.layers.{i}.", f"model.layers.{i}.")
        for i in range(int(checkpoint.raw["num_hidden_layers"]))
    ]


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor], checkpoint: CheckpointConfig
) -> dict[str, torch.Tensor]:
    """Map a Hugging Face MoE state dict to megatron ``GPTModel`` parameter names.

    Args:
        hf: Hugging Face tensors by name (as ``load_hf_state_dict`` returns them).
        checkpoint: The checked ``config.json``.

    Returns:
        Megatron tensors by name, for ``GPTModel.load_state_dict(strict=True)`` (which also
        catches anything this mapping forgot).
    """
    out = {mg: hf[name] for mg, name in _renamed(checkpoint)}
    for mg, name in _layers(checkpoint):
        attn = name + "self_attn."
        for kind in _qkv_kinds(checkpoint):
            out[f"{mg}self_attention.linear_qkv.{kind}"] = _qkv_to_megatron(
                hf[f"{attn}q_proj.{kind}"],
                hf[f"{attn}k_proj.{kind}"],
                hf[f"{attn}v_proj.{kind}"],
                checkpoint,
            )
    for mg, name, (gate, up, _) in _mlps(checkpoint):
        # Megatron's gated linear unit splits fc1's rows as [gate; up].
        out[mg + "linear_fc1.weight"] = torch.cat(
            [hf[f"{name}{gate}.weight"], hf[f"{name}{up}.weight"]], dim=0
        )
    _fused_to_megatron(hf, checkpoint, out)
    return out


def _qkv_kinds(checkpoint: CheckpointConfig) -> tuple[str, ...]:
    fields = checkpoint.fields
    if fields.get("multi_latent_attention"):
        return ()  # no fused qkv: ``_latent_attention`` names its tensors
    return ("weight", "bias") if fields["add_qkv_bias"] else ("weight",)


def read_mtp_tensors(
    model_dir: str | Path, checkpoint: CheckpointConfig
) -> dict[str, torch.Tensor]:
    """The checkpoint's multi-token-prediction tensors (``model.layers.{N + i}.*`` after the
    ``N = num_hidden_layers`` decoder layers), which ``hf_to_megatron`` leaves out; read alone,
    so an export can carry them over unchanged."""
    from safetensors import safe_open

    first = int(checkpoint.raw["num_hidden_layers"])
    prefixes = tuple(f"model.layers.{first + i}." for i in range(checkpoint.mtp_layers))
    if not prefixes:
        return {}
    out = {}
    for path in _weight_files(Path(model_dir)):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                if name.startswith(prefixes):
                    out[name] = f.get_tensor(name)
    return out


def megatron_to_hf(
    mg: Mapping[str, torch.Tensor], checkpoint: CheckpointConfig
) -> dict[str, torch.Tensor]:
    """The inverse of ``hf_to_megatron``: megatron parameters to Hugging Face names.

    Args:
        mg: Megatron tensors by name (``GPTModel.state_dict()``; extra entries such as
            ``_extra_state`` are ignored).
        checkpoint: The checked ``config.json`` of the checkpoint the model was built from.

    Returns:
        Hugging Face tensors by name, contiguous, ready for ``safetensors.torch.save_file``.
    """
    out = {hf: mg[name] for name, hf in _renamed(checkpoint)}
    for name, hf in _layers(checkpoint):
        attn = hf + "self_attn."
        for kind in _qkv_kinds(checkpoint):
            q, k, v = _qkv_to_hf(mg[f"{name}self_attention.linear_qkv.{kind}"], checkpoint)
            out[f"{attn}q_proj.{kind}"], out[f"{attn}k_proj.{kind}"] = q, k
            out[f"{attn}v_proj.{kind}"] = v
    for name, hf, (gate_name, up_name, _) in _mlps(checkpoint):
        gate, up = mg[name + "linear_fc1.weight"].chunk(2, dim=0)
        out[f"{hf}{gate_name}.weight"], out[f"{hf}{up_name}.weight"] = gate, up
    _fused_to_hf(mg, checkpoint, out)
    return {name: t.detach().contiguous() for name, t in out.items()}
