"""Trainer checkpoints: save every N steps, resume from the last one.

A checkpoint is one file, ``checkpoint_dir/step_NNNNNN.pt`` (N = steps completed), written under
a temporary name and renamed, then named in ``checkpoint_dir/latest``. It holds what the next
step depends on:

- the model's parameters (megatron names, ``GPTModel.state_dict()``),
- the optimizer (torch AdamW's moments and step counts, and the float32 master weights of a
  bf16 model: the bf16 parameters alone cannot restore them),
- the number of steps completed (the restarted loop skips that many planned batches),
- the RNG states: torch's CPU generator, megatron's RNG tracker streams, numpy's and Python's
  global generators,
- the configuration it was written under (for inspection; not enforced).

Resume (``train.resume``, on by default): when ``checkpoint_dir`` has a checkpoint, ``train()``
loads it before the first step and continues from its step, so a restarted trainer gives the
same losses and weights as one that never stopped (tested bitwise). Under data parallel, DP
rank 0 writes it and every rank loads it: weights, optimizer state and RNG streams are the same
on every DP rank. A job whose rank was killed mid-step and that was restarted also ends bitwise
equal (``tests/trainer/test_resume.py``).

Under tensor, expert or pipeline parallelism each rank holds its own shard of the weights and
optimizer state and its own RNG streams, so every rank writes its own file,
``step_NNNNNN.<shard>.pt`` (``shard`` names its pipeline stage, when there are several, and its
TP, EP and DP ranks), and loads its own; the
step is named in ``latest`` only once every rank's file is written (the caller's barrier), so a
resume never mixes steps. A resume under other parallel sizes finds no file of its name and says so.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)


def _tracker():
    try:
        from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

        return get_cuda_rng_tracker()
    except ImportError:  # pragma: no cover
        return None


def rng_state() -> dict:
    tracker = _tracker()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "megatron": tracker.get_states() if tracker is not None else None,
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    tracker = _tracker()
    if tracker is not None and state.get("megatron") is not None:
        tracker.set_states(state["megatron"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])


def _path(root: Path, stem: str, shard: str) -> Path:
    return root / (f"{stem}.{shard}.pt" if shard else f"{stem}.pt")


def save(
    checkpoint_dir: str | Path,
    steps_done: int,
    built,
    optimizer,
    config=None,
    *,
    shard: str = "",
    mark: bool = True,
) -> Path:
    """Write the checkpoint after ``steps_done`` steps; returns its path.

    Args:
        shard: This rank's name under model parallelism (its own file); "" for the whole model.
        mark: Name the step in ``latest`` (for shards: once every rank has written, ``mark``).
    """
    root = Path(checkpoint_dir)
    root.mkdir(parents=True, exist_ok=True)
    path = _path(root, f"step_{steps_done:06d}", shard)
    state = {
        "step": steps_done,
        "model": {
            k: v for k, v in built.model.state_dict().items() if not k.endswith("_extra_state")
        },
        "optimizer": optimizer.state_dict(),
        "rng": rng_state(),
        "config": dataclasses.asdict(config) if config is not None else None,
    }
    tmp = path.with_name(f".{path.name}.tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)
    if mark:
        mark_latest(root, steps_done)
    return path


def mark_latest(checkpoint_dir: str | Path, steps_done: int) -> None:
    """Name the checkpoint after ``steps_done`` steps in ``checkpoint_dir/latest``."""
    root = Path(checkpoint_dir)
    tmp = root / ".latest.tmp"
    tmp.write_text(f"step_{steps_done:06d}\n")
    os.replace(tmp, root / "latest")


def latest(checkpoint_dir: str | Path | None, shard: str = "") -> Path | None:
    """The last checkpoint in ``checkpoint_dir`` (None when there is none); with ``shard``,
    this rank's file of the step ``latest`` names.

    Raises:
        FileNotFoundError: ``latest`` names a step without this shard's file (written under
            other parallel sizes).
    """
    if not checkpoint_dir:
        return None
    root = Path(checkpoint_dir)
    marker = root / "latest"
    if marker.exists():
        path = _path(root, marker.read_text().strip().removesuffix(".pt"), shard)
        if path.exists():
            return path
        if shard:
            raise FileNotFoundError(
                f"checkpoint {marker.read_text().strip()} in {root} has no file {path.name} "
                f"for this rank (written under other parallel sizes?)"
            )
    if shard:  # only ``latest`` says that every rank's file of a step was written
        return None
    found = sorted(root.glob("step_??????.pt"))
    return found[-1] if found else None


def load(path: str | Path, built, optimizer) -> int:
    """Restore model, optimizer and RNG states from ``path``; returns the steps completed."""
    state = torch.load(path, map_location="cpu", weights_only=False)
    missing, unexpected = built.model.load_state_dict(state["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not fit this model: missing {missing}, unexpected {unexpected}"
        )
    optimizer.load_state_dict(state["optimizer"])
    set_rng_state(state["rng"])
    log.info("resumed from %s (%d steps done)", path, state["step"])
    return int(state["step"])


def save_step(config, built, optimizer, step: int, dp) -> None:
    """Checkpoint after ``step``: the lead writes the one file (data parallel: every rank holds
    the same state), or every rank its shard and the lead names the step once all have."""
    root, done = config.train.checkpoint_dir, step + 1
    if dp.model is None:
        if dp.lead:
            save(root, done, built, optimizer, config)
        return
    save(root, done, built, optimizer, config, shard=dp.model.shard, mark=False)
    torch.distributed.barrier()
    if dp.lead:
        mark_latest(root, done)
