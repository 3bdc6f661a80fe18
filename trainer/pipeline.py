"""Router replay under megatron's pipeline schedules (1F1B, with or without recompute).

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
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

from trainer.replay import RouterReplayControl


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
