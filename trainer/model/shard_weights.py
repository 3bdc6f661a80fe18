"""The full checkpoint's weights cut to what one rank holds under the parallel sizes.

``hf_weights.hf_to_megatron`` gives the whole model under megatron's names with global layer
numbers and global expert numbers, unsharded. A rank's ``GPTModel`` holds less: its pipeline
stage's layers (numbered from 0 in its state dict), its expert-parallel range of experts
(``local_experts.0..n-1``), and a tensor-parallel slice of each parallel linear layer.
``local_weights`` maps each of the rank's parameters back to its global source with
megatron's own metadata, so the rules stay megatron's:

- layer: ``TransformerLayer.layer_number`` (1-based, already offset by megatron's
  ``get_transformer_layer_offset`` for this pipeline rank and virtual stage);
- expert: ``ep_group.rank() * num_local_experts + local index`` (``SequentialMLP``'s own rule,
  the one its ``sharded_state_dict`` uses);
- tensor-parallel slice: the owning layer's class and its ``tp_group`` (the expert TP group
  for experts): rows of column-parallel layers (``linear_qkv``, ``linear_fc1``, embedding and
  output layer by vocabulary), columns of row-parallel ones (``linear_proj``, ``linear_fc2``).
  (The parameters' own ``tensor_model_parallel`` / ``partition_dim`` attributes cannot be
  used: megatron sets them only when it initialises the weight, and a loaded model skips
  that. ``local_weights`` sets them, as initialisation would.)

Biases follow their layer: a column-parallel layer's is split like its rows, a row-parallel
layer's is whole on every rank (added after the reduction). gpt-oss's sinks
(``core_attention.softmax_offset``, one per query head) are split like the heads.

Two weights need care in how their rows are ordered. ``linear_qkv``'s rows are grouped per
query group (its query heads, its key head, its value head), so a contiguous slice is whole
query groups, which is what each TP rank computes. ``linear_fc1`` of a gated MLP is
``[gate; up]``, and each rank holds ``[gate slice; up slice]``: both halves are split, not the
concatenation (a plain split would give rank 0 all of gate and rank 1 all of up).

``full_weights`` is the inverse, a collective: every rank's share gathered back into the full,
globally named tensors (for exporting the weights of a model-parallel trainer).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from trainer.model.hf_config import UnsupportedConfig

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.*)")
_EXPERT = re.compile(r"mlp\.experts\.local_experts\.(\d+)\.(.*)")


def global_name(model: torch.nn.Module, name: str) -> str:
    """The unsharded, globally numbered name of parameter ``name`` of this rank's model."""
    match = _LAYER.fullmatch(name)
    if match is None:
        return name
    layer = model.decoder.layers[int(match[1])]
    rest = match[2]
    expert = _EXPERT.fullmatch(rest)
    if expert is not None:
        experts = layer.mlp.experts
        first = experts.ep_group.rank() * experts.num_local_experts
        rest = f"mlp.experts.local_experts.{first + int(expert[1])}.{expert[2]}"
    return f"decoder.layers.{layer.layer_number - 1}.{rest}"


def partition_dim(module: torch.nn.Module) -> int | None:
    """The dimension a tensor-parallel layer splits its weight along (None: replicated)."""
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
    )

    if isinstance(module, ColumnParallelLinear | VocabParallelEmbedding):
        return 0
    if isinstance(module, RowParallelLinear):
        return 1
    return None


def tp_dim(owner: torch.nn.Module, name: str) -> int | None:
    """The dimension TP splits parameter ``name`` of ``owner`` along (None: replicated)."""
    if name.endswith("softmax_offset"):
        return 0  # per query head, and each TP rank holds whole query groups
    dim = partition_dim(owner)
    if dim == 1 and name.endswith(".bias"):
        return None  # a row-parallel layer's bias is added after the reduction
    return dim


def _gated(gated: bool, name: str) -> bool:
    return gated and name.endswith(("linear_fc1.weight", "linear_fc1.bias"))


def tp_slice(full: torch.Tensor, dim: int | None, rank: int, size: int, *, gated: bool):
    """TP rank ``rank`` of ``size``'s slice of ``full`` along ``dim`` (None: all of it);
    ``gated``: fc1 of a gated MLP, whose gate and up halves are split each."""
    if size == 1 or dim is None:
        return full
    if gated:
        return torch.cat([half.chunk(size, dim)[rank] for half in full.chunk(2, dim)], dim)
    return full.chunk(size, dim)[rank]


def local_weights(
    model: torch.nn.Module, full: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """Every parameter of this rank's ``model`` cut from the full megatron-named ``full``.

    Args:
        model: This rank's ``GPTModel`` (one pipeline stage or virtual-stage chunk).
        full: ``hf_weights.hf_to_megatron`` of the checkpoint.

    Returns:
        ``model``'s state-dict names (``_extra_state`` left out) -> tensors of their shapes,
        for ``model.load_state_dict(..., strict=False)``.

    Raises:
        UnsupportedConfig: A parameter has no source in ``full``, or its slice has the wrong
            shape (naming the parameter and both names).
    """
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    gated = model.config.gated_linear_unit
    tied = getattr(model, "share_embeddings_and_output_weights", False)
    out = {}
    for name, param in model.state_dict(keep_vars=True).items():
        if name.endswith("_extra_state"):
            continue
        source = global_name(model, name)
        if source == "output_layer.weight" and tied:
            # A later pipeline stage keeps its own copy of the tied embedding.
            source = "embedding.word_embeddings.weight"
        if source not in full:
            raise UnsupportedConfig(f"megatron parameter {name} ({source}) has no source weight")
        owner = model.get_submodule(name.rpartition(".")[0])
        dim = tp_dim(owner, name)
        group = owner.tp_group if dim is not None else None
        rank, size = (group.rank(), group.size()) if group is not None else (0, 1)
        tensor = tp_slice(full[source], dim, rank, size, gated=_gated(gated, name))
        if tensor.shape != param.shape:
            raise UnsupportedConfig(
                f"{name} ({source}): TP rank {rank} of {size} gets {tuple(tensor.shape)} from "
                f"{tuple(full[source].shape)}, the parameter is {tuple(param.shape)}"
            )
        if dim is not None and not hasattr(param, "tensor_model_parallel"):
            # Megatron sets these only when it initialises the weight itself; its gradient
            # norm and distributed checkpoints read them.
            set_tensor_model_parallel_attributes(param, True, dim, 1)
        out[name] = tensor
    return out


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The inverse of ``local_weights``: this rank's parameters gathered over their TP and EP
    groups into the full, globally named tensors of its pipeline stage or chunk (what
    ``hf_weights.megatron_to_hf`` reads). A collective: every rank of the model's TP and EP
    groups calls it, for the same chunks in the same order.

    Args:
        model: This rank's ``GPTModel``.

    Returns:
        Global megatron names -> full tensors (a later stage's copy of a tied output layer
        left out: it is the embedding).
    """
    gated = model.config.gated_linear_unit
    tied = getattr(model, "share_embeddings_and_output_weights", False)
    out = {}
    for name, tensor in model.state_dict().items():
        if name.endswith("_extra_state") or (tied and name == "output_layer.weight"):
            continue
        owner = model.get_submodule(name.rpartition(".")[0])
        dim = tp_dim(owner, name)
        if dim is not None and owner.tp_group.size() > 1:
            parts = _all_gather(tensor, owner.tp_group)
            if _gated(gated, name):
                halves = [torch.cat([p.chunk(2, dim)[h] for p in parts], dim) for h in (0, 1)]
                tensor = torch.cat(halves, dim)
            else:
                tensor = torch.cat(parts, dim)
        match = _LAYER.fullmatch(name)
        expert = _EXPERT.fullmatch(match[2]) if match else None
        if expert is None:
            out[global_name(model, name)] = tensor.clone()
            continue
        # EP rank r holds global experts [r * n, (r + 1) * n).
        layer = model.decoder.layers[int(match[1])]
        experts = layer.mlp.experts
        prefix = f"decoder.layers.{layer.layer_number - 1}.mlp.experts.local_experts."
        for r, part in enumerate(_all_gather(tensor, experts.ep_group)):
            out[f"{prefix}{r * experts.num_local_experts + int(expert[1])}.{expert[2]}"] = part
    return out


def _all_gather(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's ``tensor`` in ``group`` rank order (a copy)."""
    if group.size() == 1:
        return [tensor.clone()]
    parts = [torch.empty_like(tensor) for _ in range(group.size())]
    torch.distributed.all_gather(parts, tensor.contiguous(), group=group)
    return parts
