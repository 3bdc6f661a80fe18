"""Realistic synthetic records, for the demo, the tests and the benchmarks.

Routes are distinct top-k expert ids per token and layer, drawn either uniformly or with a
Zipf-like expert popularity per layer (trained routers are skewed: a few experts per layer
take much of the load).
"""

from __future__ import annotations

import numpy as np

from routereplay.domain.record import Geometry, Record, Turn

QWEN3_30B_A3B = Geometry(tuple(range(48)), topk=8, num_experts=128, model_id="Qwen3-30B-A3B")
# 61 hidden layers, the first 3 dense; 58 MoE layers of top-8 among 256 routed experts.
DEEPSEEK_V3 = Geometry(tuple(range(3, 61)), topk=8, num_experts=256, model_id="DeepSeek-V3")


def synthetic_routes(
    geometry: Geometry, rows: int, rng: np.random.Generator, skew: float = 0.0
) -> np.ndarray:
    """``[rows, L, k]`` distinct expert ids of ``geometry.dtype``, in draw order.

    Each token's top-k is drawn without replacement: k draws from the layer's expert
    distribution, then only the positions that repeat an earlier one are drawn again.

    Args:
        skew: 0 for uniform; s > 0 weighs the j-th most popular expert of a layer by j^-s
            (popularity order differs per layer).
    """
    layers, experts, k = geometry.num_moe_layers, geometry.num_experts, geometry.topk
    if skew > 0:
        weights = np.arange(1, experts + 1, dtype=np.float64) ** -skew
        cdfs = np.stack([np.cumsum(weights[rng.permutation(experts)]) for _ in range(layers)])
        # Layer j's CDF shifted into [j, j + 1]: one sorted array serves every layer.
        stacked = (cdfs / cdfs[:, -1:] + np.arange(layers)[:, None]).ravel()

        def draw(n: int, layer: np.ndarray) -> np.ndarray:
            found = np.searchsorted(stacked, rng.random(n) + layer) - layer * experts
            return np.minimum(found, experts - 1)

        layer_of = np.broadcast_to(np.arange(layers)[None, :, None], (rows, layers, k))
        ids = draw(rows * layers * k, layer_of.ravel()).reshape(rows, layers, k)
    else:

        def draw(n: int, layer: np.ndarray) -> np.ndarray:
            return rng.integers(0, experts, n)

        ids = rng.integers(0, experts, (rows, layers, k))
    while True:
        repeated = np.zeros(ids.shape, bool)
        for j in range(1, k):
            repeated[..., j] = (ids[..., :j] == ids[..., j : j + 1]).any(axis=-1)
        where = np.nonzero(repeated)
        if not where[0].size:
            return ids.astype(geometry.dtype)
        ids[where] = draw(where[0].size, where[1])


def synthetic_record(
    sample_id: str,
    geometry: Geometry,
    num_tokens: int,
    rng: np.random.Generator,
    skew: float = 0.0,
    prompt_tokens: int | None = None,
    vocab: int = 32000,
    group_id: str = "",
    policy_version: int = 0,
) -> Record:
    """One single-turn record: a prompt, then generated tokens with their log-probs."""
    prompt_tokens = num_tokens // 4 if prompt_tokens is None else prompt_tokens
    generated = num_tokens - prompt_tokens
    turn = Turn(
        0,
        num_tokens,
        prompt_tokens,
        policy_version,
        -rng.exponential(size=generated).astype(np.float32),
    )
    return Record(
        sample_id=sample_id,
        geometry=geometry,
        token_ids=rng.integers(0, vocab, num_tokens, dtype=np.int32),
        routes=synthetic_routes(geometry, num_tokens - 1, rng, skew),
        turns=[turn],
        group_id=group_id,
    )
