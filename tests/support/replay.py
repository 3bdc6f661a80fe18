"""Natural routes recorded through megatron's own ``RECORD`` action: the tests' reference for
what a model's routers choose, outside the RL step (which reads its passes through
``RouterReplayControl.observe``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from trainer.model.replay import RouterReplayControl


@contextlib.contextmanager
def recording(control: RouterReplayControl, into: list[list[torch.Tensor]]) -> Iterator[None]:
    """Run one forward pass with natural routing and append what each router chose: ``into``
    gets one list (per router, int64 ``[tokens, topk]``) per call (``RECORD`` keeps only the
    last forward)."""
    for r in control.routers:
        r.replay.set_router_replay_action(RouterReplayAction.RECORD)
    try:
        yield
    finally:
        for r in control.routers:
            r.replay.clear_router_replay_action()
    into.append([r.replay.get_recorded_indices() for r in control.routers])
