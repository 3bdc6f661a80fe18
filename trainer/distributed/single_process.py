"""A world of one rank: the single-process trainer and the tests that build one model in-process
(every group has size 1; torchrun worlds are in ``world``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer.patches import cpu_compat


def init_single_process(init_method: str, seed: int = 0):
    """Start a world of one rank (gloo) and megatron's model-parallel state over it.

    Args:
        init_method: A ``torch.distributed`` init URL, e.g. ``tcp://127.0.0.1:PORT`` or
            ``file:///tmp/some-file`` (the caller picks it; nothing reads the environment).
        seed: Seed of megatron's RNG tracker streams.

    Returns:
        A ``megatron.core.process_groups_config.ProcessGroupCollection`` for the model builder.
    """
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.process_groups_config import ProcessGroupCollection

    cpu_compat.apply()
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=0, world_size=1)
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)
    return ProcessGroupCollection.use_mpu_process_groups()


def shutdown() -> None:
    """Tear down megatron's state and the process group (an abort at exit otherwise)."""
    from megatron.core import parallel_state

    parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
