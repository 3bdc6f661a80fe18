"""Trained weights back to the Hugging Face format the rollout server loads.

``export_hf(built, source_dir, out_dir)`` writes a checkpoint folder that the rollout server's
``UpdateWeights(path)`` (and ``transformers.AutoModelForCausalLM.from_pretrained``) loads:

- the weights: megatron's parameters mapped back by ``hf_weights.megatron_to_hf`` (the inverse
  of the mapping ``build_model`` loads with; untouched weights come back bitwise equal), cast to
  the source checkpoint's ``dtype`` from ``config.json`` (a bf16 trainer's parameters leave as
  the served dtype), one ``model.safetensors`` file or shards with an index beyond
  ``max_shard_bytes``;
- the source's multi-token-prediction layers (``model.layers.{num_hidden_layers + i}``), which
  the trainer does not build, copied unchanged (``hf_weights.read_mtp_tensors``);
- every other file of the source folder, copied unchanged: ``config.json``, the tokenizer
  files, ``generation_config.json``, chat templates (everything but the weights and their index).

The folder appears atomically: it is written beside ``out_dir`` under a temporary name and
renamed, so a server never reads a half-written export. Under tensor or expert parallelism
every rank gathers the full tensors (``shard_weights.full_weights``, a collective) and one rank
passes them as ``weights``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from trainer.config import TrainerConfig
from trainer.distributed.dp import DataParallel
from trainer.model.hf_weights import megatron_to_hf, read_mtp_tensors
from trainer.model.shard_weights import full_weights

log = logging.getLogger(__name__)

WEIGHT_FILES = ("model.safetensors.index.json",)
MAX_SHARD_BYTES = 4 << 30
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def served_dtype(hf_config: dict) -> torch.dtype | None:
    """The dtype the checkpoint declares (``dtype``, or transformers 4's ``torch_dtype``)."""
    name = hf_config.get("dtype") or hf_config.get("torch_dtype")
    return _DTYPES.get(str(name)) if name else None


def hf_state_dict(
    built, dtype: torch.dtype | None = None, weights: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The model's weights under Hugging Face names, contiguous, on the CPU.

    Args:
        built: A ``TrainerModel``.
        dtype: Cast to this dtype (default: the checkpoint's ``served_dtype``; unchanged when
            the checkpoint declares none).
        weights: The whole model under megatron's global names (default: ``built.model``'s
            state dict, the whole model on one rank).
    """
    dtype = dtype or served_dtype(built.checkpoint.raw)
    if weights is None:
        weights = built.model.state_dict()
    state = megatron_to_hf(weights, built.checkpoint)
    out = {}
    for name, t in state.items():
        t = t.detach().cpu()
        if dtype is not None and t.dtype != dtype:
            t = t.to(dtype)
        out[name] = t.contiguous()
    return out


def _shards(state: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def export_hf(
    built,
    source_dir: str | Path,
    out_dir: str | Path,
    *,
    dtype: torch.dtype | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    weights: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Write the model as a Hugging Face checkpoint folder at ``out_dir`` (replaced if present).

    Args:
        built: The ``TrainerModel`` (built from ``source_dir``).
        source_dir: The checkpoint folder the model was built from (its non-weight files are
            copied).
        out_dir: The folder to write.
        dtype: Weight dtype (default: the source's ``config.json`` dtype).
        max_shard_bytes: Split the weights into shards of at most this size (plus an index).
        weights: The whole model under megatron's global names (``hf_state_dict``).

    Returns:
        ``out_dir`` as a ``Path``.
    """
    from safetensors.torch import save_file

    source, out = Path(source_dir), Path(out_dir)
    out.parent.mkdir(parents=True, exist_ok=True)
    state = hf_state_dict(built, dtype, weights)
    state.update(read_mtp_tensors(source, built.checkpoint))
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for item in source.iterdir():
            if item.is_file() and item.suffix != ".safetensors" and item.name not in WEIGHT_FILES:
                shutil.copy2(item, tmp / item.name)
        shards = _shards(state, max_shard_bytes)
        meta = {"format": "pt"}
        if len(shards) == 1:
            save_file(shards[0], str(tmp / "model.safetensors"), metadata=meta)
        else:
            weight_map = {}
            for i, shard in enumerate(shards, 1):
                name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, str(tmp / name), metadata=meta)
                weight_map.update(dict.fromkeys(shard, name))
            total = sum(t.numel() * t.element_size() for t in state.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old.", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def export_step(
    built, source_dir: str | Path, export_dir: str | Path, step: int, weights=None
) -> Path:
    """Export after ``step`` (0-based) to ``export_dir/step_NNNNNN`` and point
    ``export_dir/latest`` (a text file with the folder's name) at it; returns the folder.
    ``weights``: as ``export_hf``'s."""
    root = Path(export_dir)
    folder = export_hf(built, source_dir, root / f"step_{step + 1:06d}", weights=weights)
    _write_atomic(root / "latest", folder.name + "\n")
    return folder


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def export_after_step(built, config: TrainerConfig, step: int, dp: DataParallel) -> Path | None:
    """Export after ``step`` to ``train.export_dir`` (``export.export_step``); logs the path for
    the rollout server's ``UpdateWeights``. Under model parallelism a collective: every rank
    gathers its stage's full weights, the stages send theirs to the lead, which writes them.
    Returns the folder (the lead; None elsewhere)."""
    weights = gathered_weights(built, dp) if dp.model is not None else None
    if not dp.lead:
        return None
    folder = export_step(built, config.model.path, config.train.export_dir, step, weights)
    log.info("exported weights after step %d to %s", step, folder)
    return folder


def gathered_weights(built, dp: DataParallel) -> dict[str, torch.Tensor] | None:
    """The whole model's weights under megatron's global names on the first pipeline stage
    (None on the other stages): each stage's chunks gathered over their TP and EP groups, then
    sent to the first stage."""
    weights: dict[str, torch.Tensor] = {}
    for chunk in built.chunks:
        weights.update(full_weights(chunk))
    group = dp.model.pp_group
    if group is None or group.size() == 1:
        return weights
    first = torch.distributed.get_global_rank(group, 0)
    stages = [None] * group.size() if group.rank() == 0 else None
    torch.distributed.gather_object(weights, stages, dst=first, group=group)
    if stages is None:
        return None
    return {name: tensor for stage in stages for name, tensor in stage.items()}
