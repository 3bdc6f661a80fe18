"""The expert-id check: the numba kernels and the numpy path give the same first bad row as a
plain per-row reference, on every dtype, top-k and expert count the families use, and on the
edges of the SWAR range test (bounds 1, 128, 129, 255, 256)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from routereplay.domain import idcheck
from routereplay.domain.idcheck import first_bad_row

PATHS = [False, True] if idcheck.HAVE_NUMBA else [False]


def reference(ids: np.ndarray, num_experts: int) -> int | None:
    for i, row in enumerate(ids.tolist()):
        if max(row) >= num_experts or len(set(row)) != len(row):
            return i
    return None


def good_rows(rng, n: int, k: int, num_experts: int, dtype) -> np.ndarray:
    return np.stack([rng.choice(num_experts, k, replace=False) for _ in range(n)]).astype(dtype)


CASES = [  # (num_experts, k, dtype): the families' and the SWAR edges
    (128, 8, np.uint8),  # Qwen3-30B-A3B
    (256, 8, np.uint8),  # DeepSeek-V3
    (129, 8, np.uint8),
    (255, 8, np.uint8),
    (9, 8, np.uint8),
    (60, 4, np.uint8),  # Qwen2-MoE
    (8, 2, np.uint8),  # Mixtral
    (300, 6, np.dtype("<u2")),
    (65536, 8, np.dtype("<u2")),
]


@pytest.mark.parametrize("use_numba", PATHS)
@pytest.mark.parametrize("num_experts, k, dtype", CASES)
def test_good_rows_pass_and_each_planted_fault_is_found_at_its_row(
    use_numba, num_experts, k, dtype
):
    rng = np.random.default_rng(num_experts * 10 + k)
    ids = good_rows(rng, 1500, k, num_experts, dtype)
    assert first_bad_row(ids, num_experts, use_numba) is None
    pairs = [(i, j) for i in range(k) for j in range(i + 1, k)]
    for n, row in enumerate((0, 1, 1234, 1499)):
        for i, j in pairs if n == 2 else pairs[:: max(1, len(pairs) // 3)]:  # every pair once
            bad = ids.copy()
            bad[row, j] = bad[row, i]  # a repeat
            assert first_bad_row(bad, num_experts, use_numba) == row, (row, i, j)
        if num_experts < np.iinfo(dtype).max + 1:
            for value in (num_experts, np.iinfo(dtype).max):
                for col in (0, k - 1):
                    bad = ids.copy()
                    bad[row, col] = value  # out of range (distinct from the rest)
                    assert first_bad_row(bad, num_experts, use_numba) == row, (row, col, value)
    zeros = np.zeros_like(ids)  # the silent capture failure
    assert first_bad_row(zeros, num_experts, use_numba) == (0 if k > 1 else None)


@pytest.mark.parametrize("use_numba", PATHS)
def test_the_first_of_many_faults_across_stretches(use_numba):
    rng = np.random.default_rng(1)
    ids = good_rows(rng, 200_000, 8, 128, np.uint8)
    ids[150_000, 3] = ids[150_000, 5]
    ids[70_001, 0] = 200
    ids[190_000, 1] = ids[190_000, 2]
    assert first_bad_row(ids, 128, use_numba) == 70_001


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 256),
    st.integers(1, 8),
    st.integers(0, 2**32 - 1),
    st.integers(1, 40),
)
def test_paths_agree_with_the_reference_on_arbitrary_rows(num_experts, k, seed, n):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 256, (n, k))
    ids = np.where(rng.random((n, k)) < 0.9, ids % num_experts, ids).astype(np.uint8)
    expected = reference(ids, num_experts)
    for use_numba in PATHS:
        assert first_bad_row(ids, num_experts, use_numba) == expected
