"""Router replay under megatron's pipeline schedules (1F1B and interleaved 1F1B, with or without
recompute), and the model chunks of virtual pipeline stages.

Megatron's schedules (``pipeline_parallel/schedules.py``) call the user's forward step for
each micro-batch and their own ``backward_step`` for its backward. Replay needs:

- **forward**: the user's forward step runs the model inside ``RouterReplayControl.forward``
  with this stage's ids of that micro-batch (``REPLAY_FORWARD`` only for that call);
- **backward**: with activation recompute the routers run again inside ``backward_step``;
  megatron never sets ``REPLAY_BACKWARD``, and leaving ``REPLAY_FORWARD`` on would replay the
  last micro-batch's ids for every recompute (wrong gradients, no error). ``replay_backward``
  wraps the schedule module's ``backward_step`` so every backward runs inside
  ``RouterReplayControl.backward``: recomputed router calls pop their micro-batch's ids from
  the FIFO megatron fills at each ``set_target_indices``. 1F1B runs each stage's backwards in
  forward order, the FIFO's order. Without recompute no router runs in backward: harmless.

**Virtual stages** (megatron's interleaved schedule): a pipeline rank holds one model chunk per
virtual stage (``build_model_chunks``); the schedule hands the forward step the chunk it runs,
so the forward step replays that chunk's routers (``ModelChunks.controls[vp_stage]``). Each
chunk still runs its micro-batches' backwards in forward order, so one ``replay_backward`` over
every chunk's routers (``ModelChunks.replay``) keeps each router's FIFO right.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from routereplay.record import Geometry
from trainer import replay
from trainer.hf_config import (
    UnsupportedConfig,
    gpt_model_args,
    model_geometry,
)
from trainer.hf_weights import hf_to_megatron, load_hf_state_dict
from trainer.model import load_checkpoint, megatron_config, moe_routers
from trainer.replay import RouterReplayControl
from trainer.reshard import PipelineSplit, check_stage_routers, stage_moe_layers


@contextlib.contextmanager
def replay_backward(control: RouterReplayControl) -> Iterator[None]:
    """Run megatron's pipeline schedules with every ``backward_step`` under
    ``control.backward()`` (restored on exit; not re-entrant).

    Only for a step whose forward steps all replay (ids loaded for every micro-batch): a
    recompute under ``REPLAY_BACKWARD`` with nothing queued fails (empty FIFO)."""
    from megatron.core.pipeline_parallel import schedules

    original = schedules.backward_step

    @functools.wraps(original)
    def backward_step(*args, **kwargs):
        with control.backward():
            return original(*args, **kwargs)

    schedules.backward_step = backward_step
    try:
        yield
    finally:
        schedules.backward_step = original


@dataclass
class ModelChunks:
    """This pipeline rank's model chunks, one per virtual stage, with their replay.

    Attributes:
        models: The ``GPTModel`` chunks in virtual-stage order (the schedule's ``model`` list).
        controls: Per chunk the replay control of its routers (possibly none): what the
            forward step of that chunk replays.
        replay: Every chunk's routers together, for ``step()`` and ``replay_backward``.
        geometry: The routing geometry of the whole model.
    """

    models: list[torch.nn.Module]
    controls: list[RouterReplayControl]
    replay: RouterReplayControl
    geometry: Geometry

    @property
    def routers(self) -> list[replay.ReplayRouter]:
        return self.replay.routers

    def vp_stage(self, model: torch.nn.Module) -> int:
        """The virtual stage of a chunk the schedule handed over."""
        return next(v for v, m in enumerate(self.models) if m is model)


def build_model_chunks(
    model_dir: str | Path,
    *,
    pg_collection,
    load_weights: bool = False,
    model_id: str | None = None,
    **config_overrides: Any,
) -> ModelChunks:
    """Build this pipeline rank's chunks of a Qwen3-MoE checkpoint for megatron's interleaved
    schedule, replay installed on every router.

    Args:
        model_dir: Folder with the checkpoint's ``config.json`` and safetensors weights.
        pg_collection: megatron's ``ProcessGroupCollection`` (its ``pp`` group gives the rank).
        load_weights: Load each chunk's share of the checkpoint's weights
            (``model.load_checkpoint``); else random initialisation (same seed on every rank).
        model_id: Identifier stored in ``geometry`` (default: the folder's name).
        **config_overrides: ``TransformerConfig`` fields, ``virtual_pipeline_model_parallel_size``
            among them (``parallel.model_overrides`` sets it from the layout).

    Raises:
        UnsupportedConfig: No virtual stages configured.
        LayoutError: A chunk's routers differ from its share of the MoE layers
            (``reshard.stage_moe_layers``).
    """
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    hf_config, config = megatron_config(model_dir, True, load_weights, config_overrides)
    vp = config.virtual_pipeline_model_parallel_size
    if vp is None:
        raise UnsupportedConfig("build_model_chunks needs virtual_pipeline_model_parallel_size")
    pp_rank, pp_size = pg_collection.pp.rank(), pg_collection.pp.size()
    geometry = model_geometry(hf_config, model_id or Path(model_dir).name)
    split = PipelineSplit.from_config(config)
    full = hf_to_megatron(load_hf_state_dict(model_dir), hf_config) if load_weights else None
    models, chunk_routers = [], []
    for v in range(vp):
        spec = get_gpt_decoder_block_spec(
            config, use_transformer_engine=False, normalization="RMSNorm", vp_stage=v
        )
        model = GPTModel(
            config,
            spec,
            pg_collection=pg_collection,
            pre_process=pp_rank == 0 and v == 0,
            post_process=pp_rank == pp_size - 1 and v == vp - 1,
            vp_stage=v,
            **gpt_model_args(hf_config).as_kwargs(),
        )
        if full is not None:
            load_checkpoint(model, full)
        routers = moe_routers(model)
        expected = stage_moe_layers(split, geometry.moe_layers, pp_rank, vp_stage=v)
        check_stage_routers(expected, [r.layer for r in routers], f"pp {pp_rank} vp {v}: ")
        models.append(model)
        chunk_routers.append(routers)
    # One install for every chunk: it resets megatron's class-level registry each time.
    control = replay.install([r for routers in chunk_routers for r in routers])
    controls = [RouterReplayControl(routers) for routers in chunk_routers]
    return ModelChunks(models, controls, control, geometry)
