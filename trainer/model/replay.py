"""Drive megatron-core's built-in router replay for one model, with a replay mask.

Megatron gives each ``TopKRouter`` a ``RouterReplay`` when ``moe_enable_routing_replay`` is
set. It replaces only the top-k *choice*: probabilities are still the score function of the
current logits gathered at the replayed ids, so gradients reach the router.

**The mask.** Megatron's replay has no mask: under ``REPLAY_FORWARD`` every row takes the
given ids. Rows with no recorded route (each sample's final token, padding, samples whose
record is missing) must use native routing, never a filler such as "expert 0, k times". This
module marks such rows with ``-1`` in the index tensor and gives each router a
``MaskedRouterReplay``: a subclass of megatron's ``RouterReplay`` whose ``get_replay_topk``
computes the router's natural top-k from the current scores (megatron's own top-k function,
handed to it by ``topk_routing_with_score_function``) and takes it on the ``-1`` rows. That
is native routing in the same forward, on the hidden states that replay produced upstream.

Rejected alternative: filling masked rows with natural ids taken from an earlier record pass.
It costs a forward pass, and it is not native routing: the record pass runs with natural
routing everywhere, so a masked token's hidden state (which depends on earlier tokens'
experts) differs from the one it has under replay. The sentinel travels inside megatron's own
index tensors, so ``set_target_indices`` and the ``REPLAY_BACKWARD`` FIFO carry it unchanged.

**Per model, not per process.** Megatron's ``RouterReplay`` keeps a class-level registry in
construction order; two models in one process would share it. ``RouterReplayControl`` holds
the routers of one model, keyed by global layer number, and addresses their instances
directly; the model builder resets the registry and installs fresh instances, each given its
router's layer number as megatron-core 0.19 does (``RouterReplay.layer_number``).

**Actions.** ``REPLAY_FORWARD`` for forward passes; ``REPLAY_BACKWARD`` around backward when
activations are recomputed (nothing inside megatron sets it; leaving ``REPLAY_FORWARD`` on then
gives silently wrong gradients with 2 micro-batches in flight): it pops the ids of the micro-batch
being recomputed, in forward order. ``RECORD`` (the tests' reference
routes) keeps only the last forward. Indices are cleared at the end of every step (``step()``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from routereplay.domain.record import MASKED


class MaskedRouterReplay(RouterReplay):
    """Megatron's ``RouterReplay`` where rows whose ids are ``MASKED`` route natively.

    Target tensors: signed ``[tokens, topk]`` (the trainer's compact ``replay_dtype``, or the
    int64 ids a pass recorded) in megatron's token order (``[seq, batch]`` flattened, this
    rank's tokens only); a row is either ``topk`` distinct expert ids or all ``MASKED``. Each
    call widens its ids to int64 on the scores' device: the host holds and sends a quarter of
    the bytes.
    """

    observer = None
    """When set, a callable given each call's natural top-k (megatron's own selection on the
    current scores, whatever was used): int64 ``[tokens, topk]``."""

    def get_replay_topk(
        self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None
    ):
        """Top-k for one router call: recorded, replayed (masked rows natural) or natural.

        Args:
            scores: float ``[tokens, num_experts]``, what megatron takes the top-k of (logits,
                or probabilities with ``moe_router_pre_softmax``).
            topk: Experts per token.
            num_groups: Expert groups for group-limited routing (passed through).
            group_topk: Groups kept per token (passed through).
            default_compute_topk: Megatron's natural top-k, returning ``(values, indices)``.

        Returns:
            ``(values, indices)``: float ``[tokens, topk]`` gathered from ``scores`` and int64
            ``[tokens, topk]`` expert ids.
        """
        if self.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
            target = self.target_topk_idx
        elif self.router_replay_action == RouterReplayAction.REPLAY_BACKWARD:
            target = self.replay_backward_list.pop(0)
        else:
            values, natural = super().get_replay_topk(
                scores, topk, num_groups, group_topk, default_compute_topk
            )
            if self.observer is not None:
                self.observer(natural)
            return values, natural
        if target is None:
            raise RuntimeError("replay is on but no indices were set for this router")
        target = target.to(scores.device, torch.int64)
        if target.shape != (scores.shape[0], topk):
            raise ValueError(
                f"replay indices have shape {tuple(target.shape)}; this router call has "
                f"{scores.shape[0]} tokens and top-{topk}"
            )
        masked = target[:, :1] == MASKED
        if bool(masked.any()) or self.observer is not None:
            _, natural = default_compute_topk(
                scores, topk, num_groups=num_groups, group_topk=group_topk
            )
            if self.observer is not None:
                self.observer(natural)
            target = torch.where(masked, natural, target)
        return scores.gather(1, target), target


@dataclass(frozen=True)
class ReplayRouter:
    """One router of the model: its global (0-based) decoder layer number and module."""

    layer: int
    router: torch.nn.Module

    @property
    def replay(self) -> MaskedRouterReplay:
        return self.router.router_replay


class RouterReplayControl:
    """Replay actions and indices for the routers of one model (this rank's routers only).

    Args:
        routers: The model's routers in ascending global layer order.
    """

    def __init__(self, routers: Sequence[ReplayRouter]):
        self.routers = list(routers)
        self.layers = tuple(r.layer for r in self.routers)

    def _set_action(self, action: RouterReplayAction | None) -> None:
        for r in self.routers:
            if action is None:
                r.replay.clear_router_replay_action()
            else:
                r.replay.set_router_replay_action(action)

    def load(self, indices: Sequence[torch.Tensor]) -> None:
        """Queue one micro-batch's replay ids: one ``[tokens, topk]`` tensor per router,
        in ``self.routers`` order, ``MASKED`` rows routing natively."""
        if len(indices) != len(self.routers):
            raise ValueError(
                f"{len(indices)} replay tensors for {len(self.routers)} routers "
                f"(layers {list(self.layers)})"
            )
        for r, idx in zip(self.routers, indices, strict=True):
            r.replay.set_target_indices(idx)

    @contextlib.contextmanager
    def forward(self, indices: Sequence[torch.Tensor]) -> Iterator[None]:
        """Run a forward pass that replays ``indices`` (see ``load``)."""
        self.load(indices)
        self._set_action(RouterReplayAction.REPLAY_FORWARD)
        try:
            yield
        finally:
            self._set_action(None)

    @contextlib.contextmanager
    def backward(self) -> Iterator[None]:
        """Run a backward pass; recomputed router calls replay their micro-batch's ids (FIFO
        in forward order). Needed whenever activations are recomputed; harmless otherwise."""
        self._set_action(RouterReplayAction.REPLAY_BACKWARD)
        try:
            yield
        finally:
            self._set_action(None)

    @contextlib.contextmanager
    def observe(self, into: dict[int, dict[str, torch.Tensor]]) -> Iterator[None]:
        """Run one forward and keep, per router (by global layer), what it did on this rank's
        tokens: ``into[layer]["natural"]``, megatron's own top-k on the current scores (its
        natural routing, whatever was used), and ``into[layer]["used"]``, the experts its
        routing map (the router's output, after replay) sent each token to; both int64
        ``[tokens, topk]``. Calls outside the block (a recompute in backward) are not kept."""
        handles = []
        for r in self.routers:
            slot = into.setdefault(r.layer, {})
            r.replay.observer = lambda natural, slot=slot: slot.__setitem__("natural", natural)

            def used(module, args, output, slot=slot, k=r.router.topk):
                slot["used"] = routed_experts(output, k)

            handles.append(r.router.register_forward_hook(used))
        try:
            yield
        finally:
            for r, handle in zip(self.routers, handles, strict=True):
                r.replay.observer = None
                handle.remove()

    @contextlib.contextmanager
    def observe_calls(self, into: dict[int, list[torch.Tensor]]) -> Iterator[None]:
        """Keep, per router (by global layer), the experts its routing map used on every call
        inside the block, in call order (``into[layer]``: int64 ``[tokens, topk]`` each): the
        recomputed forwards of a backward."""
        handles = []
        for r in self.routers:
            calls = into.setdefault(r.layer, [])

            def used(module, args, output, calls=calls, k=r.router.topk):
                calls.append(routed_experts(output, k))

            handles.append(r.router.register_forward_hook(used))
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def clear(self) -> None:
        """Drop every queued and recorded index and the action (call at the end of a step:
        the backward FIFO grows otherwise)."""
        self._set_action(None)
        for r in self.routers:
            r.replay.clear_indices()

    @contextlib.contextmanager
    def step(self) -> Iterator[RouterReplayControl]:
        """Scope of one training step: indices are cleared when it ends, even on error."""
        try:
            yield self
        finally:
            self.clear()


def routed_experts(output, topk: int) -> torch.Tensor:
    """int64 ``[tokens, topk]``: the experts a router's output ``(probs, routing_map)`` sends
    each token to (its routing map's True entries)."""
    return output[1].detach().float().topk(topk, dim=-1).indices


def install(routers: Sequence[ReplayRouter]) -> RouterReplayControl:
    """Give each router a fresh ``MaskedRouterReplay`` and return their control.

    Resets megatron's class-level registry first, so it holds exactly these routers, in
    global layer order (what ``RouterReplay.set_replay_data`` would expect).
    """
    RouterReplay.clear_global_router_replay_instances()
    for r in routers:
        if getattr(r.router, "router_replay", None) is None:
            raise ValueError(f"layer {r.layer}: router built without moe_enable_routing_replay")
        r.router.router_replay = MaskedRouterReplay()
        # megatron-core 0.19 gives each RouterReplay its router's (1-based, global) layer number
        # when the layer is built; the router's own setter hands it to the new instance too.
        r.router.set_layer_number(r.router.layer_number)
    return RouterReplayControl(routers)
