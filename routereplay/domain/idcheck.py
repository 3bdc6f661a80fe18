"""The expert-id check: every id below the expert count and distinct within its top-k row, in
one pass over the block.

``first_bad_row(ids, num_experts)`` takes ``[n, k]`` ids (any layout whose rows are a top-k,
as row-major ``[rows, L, k]`` or layer-major ``[L, rows, k]`` blocks reshape to) and returns
the index of the first row that breaks either rule, or None.

Two implementations, the same answers (``tests/domain/test_idcheck.py`` holds them to each
other and to a per-row reference):

- **numba** (``numba`` importable: the project's environment has it through vLLM): a kernel
  compiled at first use. For top-8 uint8 ids, each row is one uint64, checked as SWAR: for
  byte rotations by 1-4 the row XOR its rotation has a zero byte exactly where two ids are
  equal (rotations by 1-4 bytes meet every pair of the 8), and the range is a per-byte
  carry-free add into the high bit; no branch per row, which LLVM vectorizes: about 1 ms for a
  12 MB 32K-token Qwen3-30B-A3B block, the speed of a memory copy (1.1 ms) on the machine of
  docs/benchmarks.md. Other shapes (uint16 ids, top-k other than 8) take a 256-bit mask per
  row (uint8), or pairwise comparisons within the row (uint16).
- **numpy** (without numba): the range as ``max()`` and the repeats as pairwise comparisons of
  the rows' columns, in L2-sized blocks (``k (k - 1) / 2`` passes: 13 ms for the same block).

The first failing row is found by scanning again only the 64K-row stretch that failed, so
the common case (nothing wrong) is the single pass.
"""

from __future__ import annotations

import numpy as np

from routereplay.domain.jit import HAVE_NUMBA, numba

# Rows per stretch: the kernel checks a stretch in one call; a failing one is scanned again
# row by row for the first bad row. 64K top-8 rows are 512 KiB.
_STRETCH_ROWS = 1 << 16


def _numpy_first_bad(ids: np.ndarray, num_experts: int) -> int | None:
    """Reference-speed path: range by max, repeats by pairwise column comparisons."""
    n, k = ids.shape
    for start in range(0, n, _STRETCH_ROWS):
        part = ids[start : start + _STRETCH_ROWS]
        bad = part >= num_experts if int(part.max()) >= num_experts else None
        columns = np.ascontiguousarray(part.T)
        repeated = np.zeros(columns.shape[1], dtype=bool)
        for i in range(k):
            for j in range(i + 1, k):
                repeated |= columns[i] == columns[j]
        if bad is not None:
            repeated |= bad.any(axis=1)
        if repeated.any():
            return start + int(np.argmax(repeated))
    return None


if HAVE_NUMBA:

    @numba.njit(nogil=True, cache=True)
    def _swar8_bad(rows, add, high_bad):  # pragma: no cover - compiled
        """OR over ``rows`` (uint64, one top-8 of uint8 ids each) of a word that is nonzero
        where a row repeats an id or holds one >= the bound encoded by ``add``/``high_bad``."""
        ones = np.uint64(0x0101010101010101)
        high = np.uint64(0x8080808080808080)
        low7 = np.uint64(0x7F7F7F7F7F7F7F7F)
        acc = np.uint64(0)
        for i in range(rows.size):
            v = rows[i]
            # Range: a byte b is out of range when its low 7 bits plus ``add`` carry into the
            # high bit (no carry between bytes: both are below 128), combined with its own
            # high bit as the bound says (high_bad: every byte >= 128 is out of range).
            over = ((v & low7) + add) & high
            over = (over | (v & high)) if high_bad else (over & v & high)
            acc |= over
            for s in (8, 16, 24, 32):
                w = v ^ ((v >> np.uint64(s)) | (v << np.uint64(64 - s)))
                acc |= (w - ones) & ~w & high
        return acc

    @numba.njit(nogil=True, cache=True)
    def _rows_bad(ids, num_experts):  # pragma: no cover - compiled
        """Index of the first bad row of ``ids`` [n, k] (any unsigned dtype), or -1."""
        n, k = ids.shape
        for r in range(n):
            for i in range(k):
                a = ids[r, i]
                if a >= num_experts:
                    return r
                for j in range(i + 1, k):
                    if ids[r, j] == a:
                        return r
        return -1

    @numba.njit(nogil=True, cache=True)
    def _mask_rows_bad(ids, num_experts):  # pragma: no cover - compiled
        """First bad row of uint8 ``ids`` [n, k] by a 256-bit mask per row, or -1."""
        n, k = ids.shape
        for r in range(n):
            m0 = np.uint64(0)
            m1 = np.uint64(0)
            m2 = np.uint64(0)
            m3 = np.uint64(0)
            count = 0
            for i in range(k):
                a = ids[r, i]
                if a >= num_experts:
                    return r
                bit = np.uint64(1) << np.uint64(a & 63)
                word = a >> 6
                if word == 0:
                    count += (m0 & bit) == 0
                    m0 |= bit
                elif word == 1:
                    count += (m1 & bit) == 0
                    m1 |= bit
                elif word == 2:
                    count += (m2 & bit) == 0
                    m2 |= bit
                else:
                    count += (m3 & bit) == 0
                    m3 |= bit
            if count != k:
                return r
        return -1


def _swar_bounds(num_experts: int) -> tuple[np.uint64, bool]:
    """``(add, high_bad)`` for ``_swar8_bad``: bytes >= num_experts (<= 256) flagged."""
    if num_experts <= 128:
        return np.uint64((128 - num_experts) * 0x0101010101010101), True
    return np.uint64((256 - num_experts) * 0x0101010101010101), False


def _numba_first_bad(ids: np.ndarray, num_experts: int) -> int | None:
    n, k = ids.shape
    if ids.dtype == np.uint8 and k == 8 and ids.flags.c_contiguous:
        add, high_bad = _swar_bounds(num_experts)
        words = ids.reshape(-1).view(np.uint64)
        for start in range(0, n, _STRETCH_ROWS):
            if _swar8_bad(words[start : start + _STRETCH_ROWS], add, high_bad):
                found = _rows_bad(ids[start : start + _STRETCH_ROWS], num_experts)
                return start + int(found)
        return None
    if ids.dtype == np.uint8:
        found = _mask_rows_bad(np.ascontiguousarray(ids), num_experts)
    else:
        found = _rows_bad(np.ascontiguousarray(ids), num_experts)
    return None if found < 0 else int(found)


def first_bad_row(ids: np.ndarray, num_experts: int, use_numba: bool | None = None) -> int | None:
    """The index of the first row of ``ids`` ``[n, k]`` (unsigned) with an id ``>=
    num_experts`` or an id repeated within the row; None when every row is good.

    ``use_numba``: force a path (tests); None picks numba when it is importable."""
    if ids.size == 0:
        return None
    if use_numba if use_numba is not None else HAVE_NUMBA:
        return _numba_first_bad(ids, num_experts)
    return _numpy_first_bad(ids, num_experts)


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernels now rather than in the first write."""
    if not HAVE_NUMBA:
        return
    for dtype, k in ((np.uint8, 8), (np.uint8, 4), (np.dtype("<u2"), 6)):
        ids = np.tile(np.arange(k, dtype=dtype), (2, 1))
        first_bad_row(ids, 300 if dtype != np.uint8 else 256)
        first_bad_row(ids, 128)
