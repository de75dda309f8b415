"""Compiled coordinate-wise selection (numba) for the trimmed mean, over a range of columns with the GIL released.

Per column of (n, d) rows: the values ranked k..n-k-1 by (value, row), the ranks of a stable sort (ties go by
row), found by introselect (quickselect from a median-of-three pivot; a segment that takes too many rounds is
sorted instead, so n log n at worst whatever values a contributor sends; a few rows: each value's rank counted),
then summed in float64 in row order: the same numbers on every CPU and thread count.
Written by hand because torch and numpy select one rank at a time, without ties by row or the sum beside it
(`kthvalue`, `topk`, `partition`), and a full sort per coordinate (O(n log n)) was most of a 1,000-contributor
round (CHANGELOG).
"""

from __future__ import annotations

import threading

import numpy as np
from numba import njit

__all__ = ["trimmed_columns", "trimmed_columns_into", "warm_up", "workspace"]

_RUN = 16  # columns gathered at a time: one 64-byte line of float32 from each row
_SMALL = 16  # segments of up to this many values are finished by insertion sort
RANK_MAX = 48  # up to this many rows, counting ranks (n^2, vectorised) is faster than selecting


@njit(nogil=True, cache=True, inline="always")
def _before(v, r, i, j):
    """Whether position i ranks before position j: a smaller value, or the same value from an earlier row."""
    return v[i] < v[j] or (v[i] == v[j] and r[i] < r[j])


@njit(nogil=True, cache=True, inline="always")
def _swap(v, r, i, j):
    v[i], v[j] = v[j], v[i]
    r[i], r[j] = r[j], r[i]


@njit(nogil=True, cache=True)
def _sort(v, r, lo, hi):
    """Sort positions [lo, hi) by (value, row): insertion sort for a few, else a stable value sort of the
    segment put in row order first (the fallback that bounds a hostile column's work)."""
    if hi - lo <= _SMALL:
        for i in range(lo + 1, hi):
            j = i
            while j > lo and _before(v, r, j, j - 1):
                _swap(v, r, j, j - 1)
                j -= 1
        return
    by_row = np.argsort(r[lo:hi])
    vs, rs = v[lo:hi][by_row], r[lo:hi][by_row]
    order = np.argsort(vs, kind="mergesort")
    v[lo:hi] = vs[order]
    r[lo:hi] = rs[order]


@njit(nogil=True, cache=True)
def _partition(v, r, lo, hi):
    """Hoare's partition of [lo, hi) around the pivot at lo, which ends at the returned position: every position
    before it ranks before the pivot, every one after ranks after. Scans from both ends and swaps only what is on
    the wrong side (a third of Lomuto's swaps); a NaN stops both scans, so it ends whatever the values."""
    pv, pr = v[lo], r[lo]
    i, j = lo, hi
    while True:
        i += 1
        while i < hi and (v[i] < pv or (v[i] == pv and r[i] < pr)):
            i += 1
        j -= 1
        while pv < v[j] or (v[j] == pv and pr < r[j]):  # stops at lo, the pivot, at the latest
            j -= 1
        if i >= j:
            break
        _swap(v, r, i, j)
    _swap(v, r, lo, j)
    return j


@njit(nogil=True, cache=True)
def _select(v, r, lo, hi, t):
    """Rearrange positions [lo, hi) so that position t holds the value of its rank there, with every value
    before it ranking before and every value after ranking after (keys are distinct: rows are)."""
    rounds, limit = 0, 2 * (int(np.log2(hi - lo + 1)) + 1)
    while hi - lo > _SMALL:
        if rounds > limit:
            _sort(v, r, lo, hi)
            return
        rounds += 1
        mid, last = (lo + hi - 1) // 2, hi - 1
        if _before(v, r, mid, lo):  # lo, mid, last in order, then their median moved to lo as the pivot
            _swap(v, r, mid, lo)
        if _before(v, r, last, lo):
            _swap(v, r, last, lo)
        if _before(v, r, last, mid):
            _swap(v, r, last, mid)
        _swap(v, r, lo, mid)
        store = _partition(v, r, lo, hi)
        if store == t:
            return
        if t < store:
            hi = store
        else:
            lo = store + 1
    _sort(v, r, lo, hi)


@njit(nogil=True, cache=True)
def _by_rank(x, k, weights, b0, w, acc, den, kept, rank):
    """Columns [b0, b0 + w) of a few rows: each value's rank counted against every other (n^2 comparisons,
    vectorised along the columns), then the kept values summed in row order. Returns the non-finite count."""
    n = x.shape[0]
    weighted = weights.shape[0] > 0
    bad = 0
    for j in range(w):
        acc[b0 + j] = 0.0
        if weighted:
            den[b0 + j] = 0.0
    for i in range(n):
        rank[:w] = 0
        for q in range(n):
            for j in range(w):
                a, b = x[q, b0 + j], x[i, b0 + j]
                rank[j] += (a < b) | ((a == b) & (q < i))
        for j in range(w):
            value = x[i, b0 + j]
            if not np.isfinite(value):
                bad += 1
            if k <= rank[j] < n - k:
                kept[i] += 1
                if weighted:
                    acc[b0 + j] += weights[i] * np.float64(value)
                    den[b0 + j] += weights[i]
                else:
                    acc[b0 + j] += np.float64(value)
    return bad


@njit(nogil=True, cache=True)
def trimmed_columns(x, k, weights, c0, c1, acc, den, kept, rank_max=RANK_MAX):
    """For each column c in [c0, c1) of x (n, d), C-contiguous float32 or float64: the values ranked k..n-k-1
    (see the module) summed in float64 in row order into acc[c]; with weights (n,) float64 (empty: unweighted)
    the sum of weights[row] * value (a rounded product, then the sum) and den[c] the sum of those weights;
    kept[row] += 1 for each value a row keeps. Up to `rank_max` rows the ranks are counted, above they are
    selected: the same kept values summed in the same order, so the same numbers either way. Returns the number
    of non-finite values read (the sums are then meaningless)."""
    n = x.shape[0]
    return trimmed_columns_into(x, k, weights, c0, c1, acc, den, kept, rank_max, np.empty(_RUN, dtype=np.int64),
                                np.empty((_RUN, n), dtype=x.dtype), np.empty(n, dtype=x.dtype),
                                np.empty(n, dtype=np.int64), np.empty(n, dtype=np.bool_))


@njit(nogil=True, cache=True)
def trimmed_columns_into(x, k, weights, c0, c1, acc, den, kept, rank_max, rank, buf, v, r, keep):
    """`trimmed_columns` in buffers the caller keeps (`workspace`): rank (_RUN,) int64, buf (_RUN, n) and v (n,)
    of x's dtype, r (n,) int64, keep (n,) bool."""
    n = x.shape[0]
    weighted = weights.shape[0] > 0
    bad = 0
    for b0 in range(c0, c1, _RUN):
        w = min(b0 + _RUN, c1) - b0
        if n <= rank_max:
            bad += _by_rank(x, k, weights, b0, w, acc, den, kept, rank)
            continue
        for i in range(n):
            for j in range(w):
                value = x[i, b0 + j]
                if not np.isfinite(value):
                    bad += 1
                buf[j, i] = value
        for j in range(w):
            col = buf[j]
            for i in range(n):
                v[i] = col[i]
                r[i] = i
                keep[i] = k == 0
            if k > 0:
                _select(v, r, 0, n, k)  # positions < k: the k values ranked first
                _select(v, r, k, n, n - k - 1)  # positions > n-k-1: the k ranked last
                for q in range(k, n - k):
                    keep[r[q]] = True
            s, sw = 0.0, 0.0
            for i in range(n):
                if keep[i]:
                    kept[i] += 1
                    if weighted:
                        s += weights[i] * np.float64(col[i])
                        sw += weights[i]
                    else:
                        s += np.float64(col[i])
            acc[b0 + j] = s
            if weighted:
                den[b0 + j] = sw
    return bad


_local = threading.local()


def workspace(n: int, dtype) -> tuple[np.ndarray, ...]:
    """This thread's buffers for `trimmed_columns_into` over n rows of `dtype`, kept from call to call: a large
    round calls the kernel for every few columns of every block, and buffers made per call (640 KB at 10,000 rows)
    were mapped and faulted in afresh each time (the server keeps large buffers out of its heap)."""
    work = getattr(_local, "work", None)
    if work is None or work[2].shape[0] != n or work[2].dtype != dtype:
        work = (np.empty(_RUN, dtype=np.int64), np.empty((_RUN, n), dtype=dtype), np.empty(n, dtype=dtype),
                np.empty(n, dtype=np.int64), np.empty(n, dtype=np.bool_))
        _local.work = work
    return work


def warm_up() -> None:
    """Compile (or load from the on-disk cache) the kernel for float32 and float64 rows, weighted or not."""
    for dtype in (np.float32, np.float64):
        x = np.zeros((3, 2), dtype=dtype)
        for weights in (np.zeros(0), np.ones(3)):
            trimmed_columns(x, 1, weights, 0, 2, np.zeros(2), np.zeros(2), np.zeros(3, dtype=np.int64))
            trimmed_columns_into(x, 1, weights, 0, 2, np.zeros(2), np.zeros(2), np.zeros(3, dtype=np.int64),
                                 RANK_MAX, *workspace(3, dtype))
