"""Route statistics against plain Python loops (the oracle) on small random routes."""

from __future__ import annotations

import numpy as np

from routereplay.dev.synthetic import synthetic_routes
from routereplay.domain.record import Geometry
from routereplay.domain.route_stats import agreement, expert_load, summarize_load

G = Geometry((1, 3, 4), topk=3, num_experts=10)


def test_expert_load_counts_every_pick():
    routes = synthetic_routes(G, 57, np.random.default_rng(0), skew=1.0)
    expected = np.zeros((3, 10), np.int64)
    for row in routes:
        for layer, ids in enumerate(row):
            for expert in ids:
                expected[layer, expert] += 1
    np.testing.assert_array_equal(expert_load(routes, 10), expected)
    summary = summarize_load(expected)
    np.testing.assert_allclose(summary.max_share, expected.max(1) / expected.sum(1))


def test_agreement_ignores_order_and_counts_shared_experts():
    rng = np.random.default_rng(1)
    a = synthetic_routes(G, 5000, rng)
    b = a[..., ::-1].copy()  # same sets, other order
    b[::3, 1, 0] = (b[::3, 1, 0] + 1) % 10  # change one expert on every third row of layer 1
    result = agreement([(a[:2000], b[:2000]), (a[2000:], b[2000:])])
    exact = np.zeros(3)
    shared = np.zeros(3)
    for x, y in zip(a, b, strict=True):
        for layer in range(3):
            common = len(set(x[layer]) & set(y[layer]))
            exact[layer] += common == 3
            shared[layer] += common / 3
    np.testing.assert_allclose(result.exact, exact / len(a))
    np.testing.assert_allclose(result.overlap, shared / len(a))
    assert result.exact[0] == 1.0 and result.exact[1] < 0.7 and result.rows == 5000
