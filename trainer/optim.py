"""The optimizer: plain ``torch.optim.AdamW``, with float32 master weights for a bf16 model.

Megatron's own optimizer and gradient clipping create CUDA tensors (docs/trainer.md), so the CPU
trainer uses torch's AdamW. With bf16 parameters, an lr-sized update is below bf16's
resolution for most weights and would round away; as in megatron's mixed precision, AdamW then
steps float32 copies and the model's bf16 parameters are refreshed from them after each step.
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

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def step(self) -> None:
        for p, m in zip(self.params, self.masters, strict=True):
            if m is not p:
                m.grad = None if p.grad is None else p.grad.float()
        self.inner.step()
        with torch.no_grad():
            for p, m in zip(self.params, self.masters, strict=True):
                if m is not p:
                    p.copy_(m)

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
