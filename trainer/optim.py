"""The optimizer: plain ``torch.optim.AdamW``, with float32 master weights for a bf16 model.

Megatron's own optimizer and gradient clipping create CUDA tensors (docs/trainer.md), so the CPU
trainer uses torch's AdamW. With bf16 parameters, an lr-sized update is below bf16's
resolution for most weights and would round away; as in megatron's mixed precision, AdamW then
steps float32 copies and the model's bf16 parameters are refreshed from them after each step.

Routers with a selection-only expert bias (aux-loss-free load balancing: GLM-4.5, DeepSeek-V3)
get their bias moved after each step, as megatron's ``finalize_model_grads`` does
(``_update_router_expert_bias``): every router counts the tokens its routing map sent to each
expert in training forwards (``local_tokens_per_expert``; under replay, the replayed routes),
and the bias of an expert above the mean count drops by ``moe_router_bias_update_rate``, below
it rises. See docs/trainer.md ("Expert bias under replay").

Each step keeps the L2 norm of the gradient it applies (``take_grad_norms``: this rank's
parameters, after the data-parallel sum; the whole model's where every rank holds it).
"""

from __future__ import annotations

import torch


class AdamW:
    """AdamW over a model's trainable parameters (float32 masters for lower precisions).

    Args:
        model: The model.
        lr: Learning rate.
        weight_decay: Decoupled weight decay.
    """

    def __init__(self, model: torch.nn.Module, lr: float, weight_decay: float = 0.0):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.masters = [
            p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_(True)
            for p in self.params
        ]
        self.inner = torch.optim.AdamW(self.masters, lr=lr, weight_decay=weight_decay)
        self.biased_routers = [
            m for m in model.modules() if getattr(m, "expert_bias", None) is not None
        ]
        self.grad_norms: list[float] = []

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        for p, m in zip(self.params, self.masters, strict=True):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
        self.grad_norms.append(self._grad_norm())
        self.inner.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters, strict=True):
                if m is not p:
                    p.copy_(m)
        self._update_expert_bias()

    def _grad_norm(self) -> float:
        """L2 norm of the gradients this step applies (float32), over this rank's parameters."""
        grads = [m.grad for m in self.masters if m.grad is not None]
        if not grads:
            return 0.0
        return float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads])))

    def take_grad_norms(self) -> list[float]:
        """The gradient norm of each step since the last call, in order."""
        norms, self.grad_norms = self.grad_norms, []
        return norms

    def _update_expert_bias(self) -> None:
        """Megatron's bias update from the step's token counts (summed over the tensor and
        data parallel ranks by ``get_updated_expert_bias``), then the counts restart."""
        if not self.biased_routers:
            return
        from megatron.core.transformer.moe.moe_utils import get_updated_expert_bias

        routers = self.biased_routers
        with torch.no_grad():
            # One collective for all routers, as megatron stacks them.
            updated = get_updated_expert_bias(
                torch.stack([r.local_tokens_per_expert for r in routers]),
                torch.stack([r.expert_bias for r in routers]),
                routers[0].config.moe_router_bias_update_rate,
            )
            for router, bias in zip(routers, updated, strict=True):
                router.expert_bias.copy_(bias)
                router.local_tokens_per_expert.zero_()

    def state_dict(self) -> dict:
        """AdamW's state and the float32 masters (a bf16 model's parameters cannot restore
        them: the masters carry the bits the bf16 copies rounded away)."""
        return {
            "inner": self.inner.state_dict(),
            "masters": [
                None if m is p else m.detach().clone()
                for p, m in zip(self.params, self.masters, strict=True)
            ],
        }

    def load_state_dict(self, state: dict) -> None:
        masters = state["masters"]
        if len(masters) != len(self.masters):
            raise ValueError(
                f"optimizer state has {len(masters)} parameters; this model has {len(self.masters)}"
            )
        with torch.no_grad():
            for m, saved in zip(self.masters, masters, strict=True):
                if saved is not None:
                    m.copy_(saved)
        self.inner.load_state_dict(state["inner"])
