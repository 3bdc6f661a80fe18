"""The optimizer keeps each step's gradient norm (the report's ``grad_norm``)."""

import math

import pytest
import torch

from trainer.optim import AdamW


def test_each_step_keeps_the_norm_of_the_gradient_it_applies():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2, bias=False))
    model = model.to(torch.bfloat16)  # bf16 parameters: the norm is taken on the fp32 masters
    optimizer = AdamW(model, lr=1e-3)
    norms = []
    for _ in range(2):
        optimizer.zero_grad()
        model(torch.randn(5, 4, dtype=torch.bfloat16)).float().pow(2).sum().backward()
        grads = [p.grad.float() for p in model.parameters()]
        norms.append(math.sqrt(sum(float(g.pow(2).sum()) for g in grads)))
        optimizer.step()
    got = optimizer.take_grad_norms()
    assert len(got) == 2 and all(n > 0 for n in got)
    assert got == pytest.approx(norms, rel=1e-6)
    assert optimizer.take_grad_norms() == []
