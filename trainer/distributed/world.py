"""Multi-rank trainer processes: megatron's parallel groups over a real world.

Launch one process per rank with ``torchrun`` (gloo on the CPU, NCCL on GPUs); ``init_world``
reads the usual ``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT`` variables that
torchrun sets, and applies ``cpu_compat.apply_multirank`` (only without CUDA).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trainer.patches import cpu_compat
from trainer.sharding import Parallelism, ParallelismError, RankCoords


@dataclass(frozen=True)
class World:
    """This process's place in the parallel world.

    Attributes:
        rank, world_size: Global rank and size.
        parallelism: The parallel sizes.
        dp_size, dp_rank: Data-parallel size and this rank's DP index.
        coords: TP / CP / PP ranks (``vp_stage`` left None: a rank holds every virtual stage).
        pg_collection: megatron's ``ProcessGroupCollection`` for the model builder.
    """

    rank: int
    world_size: int
    parallelism: Parallelism
    dp_size: int
    dp_rank: int
    coords: RankCoords
    pg_collection: object


def init_world(parallelism: Parallelism, seed: int = 1234, backend: str | None = None) -> World:
    """Join the torchrun world and build megatron's groups for ``parallelism`` over it.

    Refuses a world size that does not divide as configured before any collective runs (every
    rank raises the same ``ParallelismError``, so nothing hangs).
    """
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    dp = parallelism.dp(world_size)  # raises before the first collective
    cpu_compat.apply_multirank()
    if not dist.is_initialized():
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        dist.init_process_group(backend)
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=parallelism.tp,
        pipeline_model_parallel_size=parallelism.pp,
        virtual_pipeline_model_parallel_size=parallelism.vp,
        context_parallel_size=parallelism.cp,
        expert_model_parallel_size=parallelism.ep,
        expert_tensor_parallel_size=parallelism.expert_tp,
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    coords = RankCoords(
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        cp_rank=parallel_state.get_context_parallel_rank(),
        pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
    )
    return World(
        rank=dist.get_rank(),
        world_size=world_size,
        parallelism=parallelism,
        dp_size=dp,
        dp_rank=parallel_state.get_data_parallel_rank(),
        coords=coords,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )


def model_overrides(parallelism: Parallelism) -> dict:
    """``TransformerConfig`` fields for ``parallelism`` (pass to ``build_model``)."""
    if parallelism.cp > 1 and not _has_transformer_engine():
        raise ParallelismError(
            "context parallel needs TransformerEngine attention (not installed): only the CP "
            "split itself runs here (trainer.sharding.cp_index)"
        )
    out = dict(
        tensor_model_parallel_size=parallelism.tp,
        sequence_parallel=parallelism.sequence_parallel and parallelism.tp > 1,
        pipeline_model_parallel_size=parallelism.pp,
        context_parallel_size=parallelism.cp,
        expert_model_parallel_size=parallelism.ep,
        expert_tensor_parallel_size=parallelism.expert_tp,
    )
    if parallelism.ep > 1:
        # The EP group spans DP ranks, each with its own samples, so each rank dispatches its
        # own number of tokens: the allgather dispatcher gathers equal shapes over the TP x EP
        # group (gloo: "Received data size doesn't match" on 13 against 16 tokens); alltoall
        # exchanges per-expert split sizes first (the CPU patch above makes them lists).
        out["moe_token_dispatcher_type"] = "alltoall"
    if parallelism.vp is not None:
        out["virtual_pipeline_model_parallel_size"] = parallelism.vp
    if parallelism.pp > 1:
        # The schedules' p2p buffers need a dtype: the activations' (transformer_config's
        # params_dtype default; the trainer sets bf16 with its dtype). Every micro-batch of a
        # step has one shape (RLStep pads them): megatron's interleaved schedule with
        # variable_seq_lengths deadlocked here (unmatched shape exchanges on gloo).
        out["pipeline_dtype"] = torch.float32
        if not torch.cuda.is_available():
            # pipeline_parallel/p2p_communication.py: with batch_p2p_comm and batch_p2p_sync
            # (the defaults) every exchange ends in torch.cuda.synchronize(); plain isend/irecv
            # (_p2p_ops) works on gloo.
            out["batch_p2p_comm"] = False
    return out


def _has_transformer_engine() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True
