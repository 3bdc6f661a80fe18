"""What megatron-core 0.19.2 needs to run on a CPU-only torch, in one place.

megatron-core assumes a CUDA device in a few spots even when every tensor lives on the CPU.
``apply()`` patches exactly those spots, and only when CUDA is absent, so the GPU path is never
touched. It is idempotent and must be called before a model is built (the trainer does it; nothing
is patched at import time).

The patches, each with the megatron code that needs it (single process, local layer spec,
allgather dispatcher, no expert bias; more than one rank needs two more, ``apply_multirank``):

1. ``torch.cuda.current_device`` answers the CPU device. Megatron moves tensors "to the GPU"
   with it in ``transformer/moe/router.py`` (``Router.gating`` moves the router weight),
   ``models/common/embeddings/rotary_pos_embedding.py`` (``RotaryEmbedding.get_emb`` moves
   ``inv_freq``) and creates buffers with it elsewhere; on a CPU build it raises instead.
2. The RNG tracker of ``tensor_parallel/random.py`` (``CudaRNGStatesTracker.add`` / ``fork``,
   used by ``model_parallel_cuda_manual_seed`` and by ``DotProductAttention.forward``) keeps
   CUDA generator states; a CPU tracker keeps CPU generator states with the same contract.
3. ``tensor_parallel/random.py``: ``CheckpointFunction`` (activation recompute) saves and
   restores the "CUDA" generator state through the module functions ``_get_cuda_rng_state`` /
   ``_set_cuda_rng_state``; they read and write the CPU generator instead.
4. ``pipeline_parallel/schedules.py``: the schedules (``forward_backward_no_pipelining``,
   ``forward_backward_pipelining_with_interleaving``,
   ``forward_backward_pipelining_without_interleaving`` (1F1B)) create their token counter
   with ``total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda")``. The module's
   ``torch`` name is given a thin proxy whose ``zeros`` puts a ``device="cuda"`` tensor on the
   CPU; every other attribute is torch's own.
5. ``transformer/utils.py``, ``get_sliding_window_causal_mask`` (imported by name into
   ``fusions/fused_softmax.py``, whose ``forward_torch_softmax`` calls it in every
   sliding-window layer: gpt-oss) builds its mask with ``device="cuda"``; the same mask is
   built on the CPU instead.

megatron-core 0.16.1 needed one more: its aux-loss logging (``track_moe_metrics`` with
``force_initialize``) created tracker entries with ``device="cuda"``. 0.19's
``transformer/moe/moe_logging.py`` (``MoEMetricsTracker.ensure_initialized``) allocates on the
CPU when CUDA is absent, so that patch is gone.
"""

from __future__ import annotations

import contextlib
import copy

import torch

_APPLIED = False
_MULTIRANK_APPLIED = False


def needed() -> bool:
    """True when this torch has no usable CUDA device (the patches apply only then)."""
    return not torch.cuda.is_available()


def apply() -> bool:
    """Patch megatron-core for a CPU-only torch if CUDA is absent; a no-op otherwise.

    Returns:
        True when the patches are (now or already) in place, False when CUDA is present.
    """
    global _APPLIED
    if not needed():
        return False
    if _APPLIED:
        return True
    _patch_current_device()
    _patch_rng_tracker()
    _patch_rng_state_functions()
    _patch_schedules_token_counter()
    _patch_sliding_window_mask()
    _APPLIED = True
    return True


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def _patch_current_device() -> None:
    # Router.gating / RotaryEmbedding.get_emb: `x.to(device=torch.cuda.current_device())`.
    torch.cuda.current_device = _cpu_device


class _CpuRNGStatesTracker:
    """Mixin for megatron's ``CudaRNGStatesTracker`` that keeps CPU generator states.

    Same contract as the CUDA tracker: ``add(name, seed)`` registers a named stream seeded with
    ``seed``; ``fork(name)`` runs its body on that stream and keeps the stream's advanced state.
    """

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise Exception(f"seed {seed} already exists")
        if name in self.states_:
            raise Exception(f"rng state {name} already exists")
        self.seeds_.add(seed)
        self.states_[name] = torch.Generator().manual_seed(seed).get_state()

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        if name not in self.states_:
            raise Exception(f"rng state {name} is not added")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _patch_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    # initialize_rng_tracker() instantiates the module global CudaRNGStatesTracker; give it the
    # CPU version. model_parallel_cuda_manual_seed() also calls torch.cuda.manual_seed, which a
    # CPU build queues lazily and never runs: harmless.
    if not issubclass(mrandom.CudaRNGStatesTracker, _CpuRNGStatesTracker):
        mrandom.CudaRNGStatesTracker = type(
            "CpuRNGStatesTracker", (_CpuRNGStatesTracker, mrandom.CudaRNGStatesTracker), {}
        )
    # A tracker built before apply() would still hold CUDA states: drop it.
    mrandom.initialize_rng_tracker(force_reset=True)


def _get_cpu_rng_state(device=None, clone=False, graph_safe=False) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state, device=None, graph_safe=False) -> None:
    torch.set_rng_state(new_state)


def _patch_rng_state_functions() -> None:
    from megatron.core.tensor_parallel import random as mrandom

    # CheckpointFunction.forward/backward -> _get_all_rng_states / _set_all_rng_states.
    mrandom._get_cuda_rng_state = _get_cpu_rng_state
    mrandom._set_cuda_rng_state = _set_cpu_rng_state


class _CpuZerosTorch:
    """``torch`` for ``pipeline_parallel/schedules.py``: ``zeros(..., device="cuda")`` lands on
    the CPU; everything else is delegated to torch unchanged."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def zeros(*args, **kwargs):
        device = kwargs.get("device")
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device"] = "cpu"
        return torch.zeros(*args, **kwargs)


def _patch_schedules_token_counter() -> None:
    from megatron.core.pipeline_parallel import schedules

    # total_num_tokens = torch.zeros([], dtype=torch.int, device="cuda") in every schedule.
    if not isinstance(schedules.torch, _CpuZerosTorch):
        schedules.torch = _CpuZerosTorch()


def sliding_window_mask(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
    """megatron's sliding-window causal mask on the CPU: ``[sq, skv]`` bool, True where query
    ``i`` (at key position ``i + skv - sq``) may not see key ``j``: more than ``window_size[0]``
    before it or more than ``window_size[1]`` after it."""
    query = torch.arange(sq)[:, None] + (skv - sq)
    key = torch.arange(skv)[None, :]
    return (key < query - window_size[0]) | (key > query + window_size[1])


def _patch_sliding_window_mask() -> None:
    from megatron.core.fusions import fused_softmax

    # fused_softmax.py: `from megatron.core.transformer.utils import ...` (a name of its own).
    fused_softmax.get_sliding_window_causal_mask = sliding_window_mask


def apply_multirank() -> bool:
    """Patch megatron-core 0.19.2 for more than one rank on a CPU-only torch (no-op with CUDA).

    1. ``transformer/torch_norm.py``: ``WrappedTorchNorm`` (the norm of the local layer spec
       without TransformerEngine or apex) asserts ``not config.sequence_parallel``. RMSNorm is
       per token, so under sequence parallelism each rank normalises its own sequence shard
       with the same (replicated) weight: the norm is built from a copy of the config without
       the flag, and its parameters get ``sequence_parallel = True``, the attribute megatron's
       ``finalize_model_grads`` uses to all-reduce their gradients over the TP group. Only
       norms over ``hidden_size`` are in the sequence-parallel region (the q/k norms run after
       the gather, per head), and latent attention's ``q_layernorm`` / ``kv_layernorm``
       (widths ``q_lora_rank`` / ``kv_lora_rank``: ``MLASelfAttention`` scatters the latents
       back to the sequence shard before them; without the all-reduce, DeepSeek-V3's second
       TP2 + SP step's loss was 2.2e-6 off one rank's and natural routing after the update
       differed on 1 row of 84).
    2. ``transformer/moe/token_dispatcher.py``: ``MoEAlltoAllTokenDispatcher`` creates a
       ``torch.cuda.Stream`` at construction and, in ``_maybe_dtoh_and_synchronize``, copies
       the split sizes to the host on it. On the CPU the sizes are already host tensors, but
       ``all_to_all_single`` wants lists of ints: the patched method turns them into lists at
       the same point and records no event. The class's stream slot gets a placeholder so the
       constructor does not build a CUDA stream.

    Returns:
        True when patched (now or before), False with CUDA.
    """
    global _MULTIRANK_APPLIED
    if not apply():
        return False
    if _MULTIRANK_APPLIED:
        return True
    from megatron.core.transformer import torch_norm

    original_new = torch_norm.WrappedTorchNorm.__new__

    def new(cls, config, hidden_size, *args, **kwargs):
        if not config.sequence_parallel:
            return original_new(cls, config, hidden_size, *args, **kwargs)
        plain = copy.copy(config)
        plain.sequence_parallel = False
        norm = original_new(cls, plain, hidden_size, *args, **kwargs)
        if hidden_size in _sequence_parallel_widths(config):
            for p in norm.parameters():
                p.sequence_parallel = True
        return norm

    torch_norm.WrappedTorchNorm.__new__ = staticmethod(new)
    _patch_alltoall_dispatcher()
    _MULTIRANK_APPLIED = True
    return True


def _sequence_parallel_widths(config) -> set[int]:
    """The widths of the norms that run on a sequence-parallel shard (``apply_multirank``'s
    patch 1)."""
    widths = {config.hidden_size}
    if getattr(config, "multi_latent_attention", False):
        widths.add(config.kv_lora_rank)
        if config.q_lora_rank is not None:
            widths.add(config.q_lora_rank)
    return widths


def _patch_alltoall_dispatcher() -> None:
    from megatron.core.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher

    def host_splits(self, point, tokens_per_expert=None):
        if not self.drop_and_pad and point == self.cuda_dtoh_point:
            for name in ("input_splits", "output_splits"):
                value = getattr(self, name)
                if torch.is_tensor(value):
                    setattr(self, name, value.tolist())
        return tokens_per_expert

    MoEAlltoAllTokenDispatcher.cuda_dtoh_stream = "cpu: no stream"
    MoEAlltoAllTokenDispatcher._maybe_dtoh_and_synchronize = host_splits
