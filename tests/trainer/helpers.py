"""Test helpers: observe routers through forward hooks, a next-token loss, random batches, the
natural routes of a model as records (megatron's ``RECORD``), two runs' step reports compared."""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from routereplay.domain.record import Geometry, Record, Turn
from tests.support.replay import recording
from trainer.layout.align import routes_from_recorded
from trainer.layout.batch import PaddedBatch
from trainer.report.step_report import StepReport


@contextlib.contextmanager
def capture_routing(routers):
    """Per global layer, every call's megatron routing map (bool ``[tokens, experts]``) and
    gating logits (float ``[tokens, experts]``), in call order."""
    maps: dict[int, list[torch.Tensor]] = defaultdict(list)
    logits: dict[int, list[torch.Tensor]] = defaultdict(list)
    handles = []
    for r in routers:
        handles.append(
            r.router.register_forward_hook(
                lambda m, i, o, layer=r.layer: maps[layer].append(o[1].detach().clone())
            )
        )
        gating = r.router.gating

        def hooked(x, layer=r.layer, gating=gating):
            out = gating(x)
            logits[layer].append(out.detach().reshape(-1, out.shape[-1]).clone())
            return out

        r.router.gating = hooked
    try:
        yield maps, logits
    finally:
        for h in handles:
            h.remove()
        for r in routers:
            del r.router.gating


def one_hot(ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """int ``[tokens, k]`` -> bool ``[tokens, num_experts]``."""
    out = torch.zeros(ids.shape[0], num_experts, dtype=torch.bool)
    return out.scatter_(1, ids.long(), True)


def next_token_loss(model, batch: PaddedBatch) -> torch.Tensor:
    """Mean cross-entropy of each real token's successor (float32 scalar)."""
    logits = model(batch.token_ids, batch.position_ids(), batch.attention_mask())
    valid = batch.valid
    targets_ok = valid[:, :-1] & valid[:, 1:]
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logp.gather(-1, batch.token_ids[:, 1:, None]).squeeze(-1)
    return -(picked * targets_ok).sum() / targets_ok.sum()


def random_batch(seed: int, lengths, padding_side: str, vocab: int = 512) -> PaddedBatch:
    g = torch.Generator().manual_seed(seed)
    tokens = [torch.randint(2, vocab, (n,), generator=g).numpy() for n in lengths]
    ids = [f"s{seed}-{i}" for i in range(len(lengths))]
    return PaddedBatch.from_samples(ids, tokens, padding_side=padding_side, pad_id=1)


def make_record(sample_id: str, tokens: np.ndarray, routes: np.ndarray, geometry: Geometry):
    """A single-turn record whose generated part is everything after the first token."""
    tokens = np.asarray(tokens, dtype=np.int32)
    turn = Turn(token_start=0, token_end=tokens.size, generated_start=1)
    record = Record(sample_id, geometry, tokens, routes.astype(geometry.dtype), [turn])
    record.validate()
    return record


def random_routes(seed: int, rows: int, geometry: Geometry) -> np.ndarray:
    """``[rows, L, k]`` distinct random expert ids per token and layer."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(rows, geometry.num_moe_layers, geometry.num_experts, generator=g)
    return scores.argsort(dim=-1)[..., : geometry.topk].numpy().astype(geometry.dtype)


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def record_natural_routes(
    built,
    micro_batches: Sequence[PaddedBatch],
    forward: Callable[[torch.nn.Module, PaddedBatch], Any],
) -> tuple[list[Any], list[Record]]:
    """Run the old-logprob pass and record every sample's routes.

    Args:
        built: The model, built with ``routing_replay=True``.
        micro_batches: The batch, split into micro-batches.
        forward: ``forward(model, micro_batch)`` returning what the caller keeps (old
            log-probs); it runs without gradients.

    Returns:
        ``(outputs, records)``: ``forward``'s result per micro-batch, and one record per sample
        (in micro-batch order) whose ``routes`` ``[T - 1, L, k]`` are what this model chose.
    """
    outputs, records = [], []
    for batch in micro_batches:
        recorded: list[list[torch.Tensor]] = []
        with torch.no_grad(), built.replay.step(), recording(built.replay, recorded):
            outputs.append(forward(built.model, batch))
        routes = routes_from_recorded(batch, recorded[0], built.geometry)
        for b, sample_routes in enumerate(routes):
            tokens = batch.sample_tokens(b).numpy().astype(np.int32)
            # Which tokens were generated is the rollout's knowledge, not the trainer's.
            turn = Turn(token_start=0, token_end=tokens.size, generated_start=tokens.size)
            records.append(
                Record(batch.sample_ids[b], built.geometry, tokens, sample_routes, [turn])
            )
    return outputs, records


def replay_random_routes(built, batch: PaddedBatch, seed: int):
    """Replay distinct random routes (which ignore any group limit) on ``batch``, without
    gradients, and see what each router did.

    Returns:
        ``(aligned, rows, maps, logits, probs)``: the alignment, bool ``[tokens]`` of the rows
        replayed, and per router layer the routing map and gating logits
        (``capture_routing``) and the routing probabilities ``[tokens, experts]``.
    """
    from trainer.layout.align import align_routes

    geometry = built.geometry
    routes = [random_routes(seed + b, int(n) - 1, geometry) for b, n in enumerate(batch.lengths)]
    records = [
        make_record(batch.sample_ids[b], batch.sample_tokens(b).numpy(), routes[b], geometry)
        for b in range(batch.batch_size)
    ]
    aligned = align_routes(batch, records, geometry, built.replay.layers)
    probs: dict[int, torch.Tensor] = {}
    handles = [
        r.router.register_forward_hook(
            lambda m, i, o, layer=r.layer: probs.__setitem__(layer, o[0].detach().clone())
        )
        for r in built.routers
    ]
    try:
        with torch.no_grad(), built.replay.step(), capture_routing(built.routers) as (maps, logits):
            with built.replay.forward(aligned.indices):
                next_token_loss(built.model, batch)
    finally:
        for h in handles:
            h.remove()
    return aligned, aligned.replayed.reshape(-1), maps, logits, probs


def assert_same_counts(step: StepReport, ref: StepReport) -> None:
    """What a run in another layout reports exactly as the reference does: samples, reward,
    rows, routing and update agreement. (No pytest rewriting here: the values go in the
    messages.)"""
    assert step.samples == ref.samples, (step.samples, ref.samples)
    assert step.reward_mean == ref.reward_mean, (step.reward_mean, ref.reward_mean)
    assert step.rows == ref.rows, (step.rows, ref.rows)
    assert step.agreement == ref.agreement, (step.agreement, ref.agreement)
    assert step.update_agreement == ref.update_agreement, (
        step.update_agreement,
        ref.update_agreement,
    )


def assert_same_step(got: StepReport, want: StepReport) -> None:
    """Two runs of the same arithmetic (a resumed run, other reads): the loss, expected reward,
    gaps, routing agreement and rows, to the bit."""
    assert got.loss == want.loss, (got.loss, want.loss)
    assert got.expected_reward == want.expected_reward, (got.expected_reward, want.expected_reward)
    assert got.gap == want.gap, (got.gap, want.gap)
    assert got.agreement == want.agreement, (got.agreement, want.agreement)
    assert got.rows == want.rows, (got.rows, want.rows)
