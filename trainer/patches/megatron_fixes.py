"""Fixes of megatron-core 0.19.2 bugs the trainer runs into, on every device.

``apply()`` is idempotent and is called before a model is built.

1. ``transformer/moe/router.py``, ``TopKRouter._apply_expert_bias``: with a ``padding_mask``
   (bool ``[tokens]``, True on padding) it masks the routing map (``[tokens, experts]``) with
   ``routing_map & ~padding_mask``, which broadcasts the mask along the experts and fails for
   any model with ``moe_router_enable_expert_bias`` (DeepSeek-V3's and GLM-4.5's routers). The
   replacement masks by token, as the aux-loss and z-loss paths of the same file do; without a
   mask it is megatron's own code. Fixed upstream the same way (Megatron-LM issue 6111, pull
   request 6114); drop this once a release has it.
2. ``fusions/fused_softmax.py``, ``FusedScaleMaskSoftmax.forward_torch_softmax``: in a
   sliding-window layer (``window_size`` set) it *replaces* the caller's attention mask with
   the window mask, so padding and the block-diagonal mask of packed samples are ignored in
   those layers: a left-padded or packed sample attends to the pad or to the sample before it
   (gpt-oss's windowed layers; measured logit differences of 1.03 on a packed sample, 6e-6
   with this fix). The wrapper passes the union of both masks with the window switched off
   for the call, so megatron's own softmax runs on the combined mask. Without a caller's mask
   it is megatron's own code.
3. ``transformer/mlp.py``, ``MLP.forward``: an expert with biases (``add_bias_linear``, the
   local ``SequentialMLP`` path) adds its ``linear_fc2`` bias *in place* into ``linear_fc2``'s
   output. With expert TP size 1 (which megatron asserts for MoE biases) that output is the
   input that ``_ReduceFromModelParallelRegion`` returned as is, a view of a custom autograd
   Function's output, and autograd refuses the in-place add in any forward with gradients
   ("Output 0 of _ReduceFromModelParallelRegion is a view and is being modified inplace").
   Experts' ``linear_fc2`` outputs are cloned in forwards with gradients, so the add is on a
   tensor of its own (upstream's fix would be an out-of-place add on that line).
4. Only for megatron-core 0.16.1, which verl's environment keeps (docs/verl.md):
   ``transformer/moe/moe_utils.py``, ``RouterGatingLinearFunction`` (every router's forward
   and backward) tests ``te_general_gemm is not None``, a module global 0.16.1 defines only
   when TransformerEngine imports: a NameError on any device without it. It is defined as None,
   so the plain ``torch.mm`` branch runs. 0.19 defines it as None itself (a no-op there).

5. ``transformer/moe/moe_utils.py``, ``MoEAuxLossAutoScaler``: the aux loss's backward scale
   is a class-level tensor. A backward outside megatron's schedules (a plain ``loss.backward()``)
   creates it 0-d (``torch.tensor(1.0)``); the schedules then ``copy_`` their 1-element scale
   into it: ``RuntimeError: output with shape [] doesn't match the broadcast shape [1]``, in
   every later schedule run of the process with an aux loss. ``set_loss_scale`` reshapes the
   scale to the tensor it is copied into.

Fixes 1-3 and 5 meet the same lines in 0.19.2 as in 0.16.1, and each is still needed.
"""

from __future__ import annotations

import torch

_APPLIED = False


def apply() -> None:
    global _APPLIED
    if _APPLIED:
        return
    from megatron.core.transformer.moe.router import TopKRouter

    def _apply_expert_bias(self, routing_map, padding_mask=None):
        # Counts only in a forward that will be trained on (not evaluation or recompute).
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.unsqueeze(-1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)

    TopKRouter._apply_expert_bias = _apply_expert_bias
    _router_gemm_without_transformer_engine()
    _keep_the_mask_in_sliding_window_layers()
    _expert_bias_out_of_place()
    _aux_loss_scale_of_either_shape()
    _APPLIED = True


def _router_gemm_without_transformer_engine() -> None:
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def _keep_the_mask_in_sliding_window_layers() -> None:
    from megatron.core.fusions import fused_softmax

    softmax = fused_softmax.FusedScaleMaskSoftmax
    original = softmax.forward_torch_softmax

    def forward_torch_softmax(self, input, mask, softmax_offset=None):
        if self.window_size is None or mask is None:
            return original(self, input, mask, softmax_offset)
        # Looked up at call time: cpu_compat may have replaced it with a CPU version.
        window = fused_softmax.get_sliding_window_causal_mask(
            input.size(2), input.size(3), self.window_size
        )
        window_size, self.window_size = self.window_size, None
        try:  # True blocks, in both masks
            return original(self, input, mask | window.to(mask.device), softmax_offset)
        finally:
            self.window_size = window_size

    softmax.forward_torch_softmax = forward_torch_softmax


def _clone_output(module, args, output):
    if not torch.is_grad_enabled():
        return None
    result, bias = output
    return result.clone(), bias


def _expert_bias_out_of_place() -> None:
    from megatron.core.transformer.mlp import MLP

    original = MLP.__init__

    def __init__(self, config, submodules, *args, **kwargs):
        original(self, config, submodules, *args, **kwargs)
        is_expert = kwargs.get("is_expert", args[0] if args else False)
        if self.config.add_bias_linear and is_expert:
            self.linear_fc2.register_forward_hook(_clone_output)

    MLP.__init__ = __init__


def _aux_loss_scale_of_either_shape() -> None:
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    original = MoEAuxLossAutoScaler.set_loss_scale

    def set_loss_scale(scale: torch.Tensor) -> None:
        current = MoEAuxLossAutoScaler.main_loss_backward_scale
        if current is not None and current.shape != scale.shape:
            scale = scale.reshape(current.shape)
        original(scale)

    MoEAuxLossAutoScaler.set_loss_scale = staticmethod(set_loss_scale)
