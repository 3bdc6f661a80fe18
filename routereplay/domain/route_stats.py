"""What routes say: per-layer expert load, and how far two sets of routes agree.

Shapes: routes ``[rows, L, k]``; results are per MoE layer (``[L]`` or ``[L, E]``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

_ROWS_PER_STEP = 4096  # bounds the [rows, L, k, k] comparison scratch


def expert_load(routes: np.ndarray, num_experts: int) -> np.ndarray:
    """``[L, num_experts]`` int64: how many times each layer picked each expert."""
    layers = routes.shape[1]
    flat = routes.transpose(1, 0, 2).reshape(layers, -1).astype(np.int64)
    offsets = (np.arange(layers, dtype=np.int64) * num_experts)[:, None]
    counts = np.bincount((flat + offsets).ravel(), minlength=layers * num_experts)
    return counts.reshape(layers, num_experts)


@dataclass(frozen=True)
class LoadSummary:
    """Per layer: the busiest expert's share of the picks (1/E is perfectly balanced) and the
    entropy of the load over experts in bits (log2 E is perfectly balanced)."""

    max_share: np.ndarray
    entropy_bits: np.ndarray


def summarize_load(load: np.ndarray) -> LoadSummary:
    totals = np.maximum(load.sum(axis=1, keepdims=True), 1)
    p = load / totals
    with np.errstate(divide="ignore", invalid="ignore"):
        entropy = -np.where(p > 0, p * np.log2(p), 0.0).sum(axis=1)
    return LoadSummary(p.max(axis=1), entropy)


@dataclass(frozen=True)
class Agreement:
    """Per layer, over the compared rows: ``exact`` is the fraction of tokens whose top-k sets
    are equal; ``overlap`` the mean fraction of the k experts both picked."""

    exact: np.ndarray
    overlap: np.ndarray
    rows: int


def overlap_counts(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``[rows, L]``: how many of row's k experts appear in both (order ignored)."""
    if a.shape != b.shape:
        raise ValueError(f"routes of shape {a.shape} and {b.shape} cannot be compared")
    out = np.empty(a.shape[:2], np.int64)
    for start in range(0, a.shape[0], _ROWS_PER_STEP):
        x, y = a[start : start + _ROWS_PER_STEP], b[start : start + _ROWS_PER_STEP]
        out[start : start + _ROWS_PER_STEP] = (x[..., :, None] == y[..., None, :]).any(-1).sum(-1)
    return out


def agreement(pairs: list[tuple[np.ndarray, np.ndarray]]) -> Agreement:
    """Agreement over several (a, b) pairs of ``[rows, L, k]`` routes (for example one pair per
    sample); rows of each pair are compared up to the shorter of the two."""
    counts = [overlap_counts(a[: min(len(a), len(b))], b[: min(len(a), len(b))]) for a, b in pairs]
    counts = np.concatenate(counts) if counts else np.zeros((0, 0), np.int64)
    if counts.size == 0:
        return Agreement(np.zeros(0), np.zeros(0), 0)
    k = pairs[0][0].shape[-1]
    return Agreement((counts == k).mean(axis=0), (counts / k).mean(axis=0), counts.shape[0])
