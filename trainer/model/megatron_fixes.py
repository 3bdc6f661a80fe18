"""Fixes of megatron-core 0.16.1 bugs the trainer runs into, on every device.

``apply()`` is idempotent and is called before a model is built.

1. ``transformer/moe/router.py``, ``TopKRouter._apply_expert_bias``: with a ``padding_mask``
   (bool ``[tokens]``, True on padding) it masks the routing map (``[tokens, experts]``) with
   ``routing_map & ~padding_mask``, which broadcasts the mask along the experts and fails for
   any model with ``moe_router_enable_expert_bias`` (DeepSeek-V3's and GLM-4.5's routers). The
   replacement masks by token, as the aux-loss and z-loss paths of the same file do; without a
   mask it is megatron's own code. Fixed upstream the same way (Megatron-LM issue 6111, pull
   request 6114); drop this once a release has it.
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
    _APPLIED = True
