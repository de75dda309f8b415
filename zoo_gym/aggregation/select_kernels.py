"""Compiled coordinate-wise selection (numba) for the trimmed mean, over a range of columns with the GIL released.

Per column of (n, d) rows: the values ranked k..n-k-1 by (value, row), the ranks of a stable sort (ties go by
row), then summed in float64 in row order: the same numbers on every CPU and thread count. A few rows: each
value's rank counted. From SAMPLE_MIN float32 rows: a sample's keys bracket the two ranks (Floyd-Rivest) and
only the values between them are selected, as one int64 key each; else (or when a column defeats the sample)
introselect over the column (quickselect from a median-of-three pivot, a segment that takes too many rounds
sorted instead: n log n at worst whatever a contributor sends). Written by hand because torch and numpy select
one rank at a time, without ties by row or the sum beside it (`kthvalue`, `topk`, `partition`), and a full
sort per coordinate was most of a 1,000-contributor round (CHANGELOG).
"""

from __future__ import annotations

import threading

import numpy as np
from numba import njit

__all__ = ["trimmed_columns", "trimmed_columns_into", "warm_up", "workspace"]

_RUN = 16  # columns gathered at a time: one 64-byte line of float32 from each row
_SMALL = 16  # segments of up to this many values are finished by insertion sort
SAMPLE_MIN = 512  # from this many rows, a sample brackets the two ranks first (`_keep_by_sample`)
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


@njit(nogil=True, cache=True, inline="always")
def _key(bits, i):
    """(value, row) as one int64 that orders as they do: float32 bits made monotone (-0.0 as +0.0), then the row."""
    b = np.int64(bits) ^ ((np.int64(bits) >> 31) & 0x7FFFFFFF)
    return (b + (b == -1)) * 4294967296 + i


@njit(nogil=True, cache=True)
def _select_keys(a, lo, hi, t):
    """`_select` on distinct int64 keys: position t of [lo, hi) holds its rank's key, lesser keys before it. The
    same loop as `_select` and `_partition`, differing only in the comparison: one int64 here, where `_select`'s
    (value, row) pairs (float64 rows have no such key) compare as two."""
    rounds, limit = 0, 2 * (int(np.log2(hi - lo + 1)) + 1)
    while hi - lo > _SMALL:
        if rounds > limit:
            a[lo:hi] = np.sort(a[lo:hi])
            return
        rounds += 1
        mid, last = (lo + hi - 1) // 2, hi - 1
        if a[mid] < a[lo]:
            a[mid], a[lo] = a[lo], a[mid]
        if a[last] < a[lo]:
            a[last], a[lo] = a[lo], a[last]
        if a[last] < a[mid]:
            a[last], a[mid] = a[mid], a[last]
        a[lo], a[mid] = a[mid], a[lo]
        pivot, i, j = a[lo], lo, hi
        while True:  # Hoare's partition, as `_partition`
            i += 1
            while i < hi and a[i] < pivot:
                i += 1
            j -= 1
            while pivot < a[j]:
                j -= 1
            if i >= j:
                break
            a[i], a[j] = a[j], a[i]
        a[lo], a[j] = a[j], a[lo]
        if j == t:
            return
        if t < j:
            hi = j
        else:
            lo = j + 1
    a[lo:hi] = np.sort(a[lo:hi])


@njit(nogil=True, cache=True)
def _keep_by_sample(bits, k, keep, keys):
    """Mark keep[i] for the float32 values (`bits`, their int32 view, n rows) ranked k..n-k-1, Floyd-Rivest's
    way: the keys a strided sample ranks around k and n-k bracket those ranks with high probability; one pass
    without branches files every value as surely trimmed, surely kept or a candidate, and only the candidates
    are selected (`keys` (n,) int64: the lower ones from the front, the upper from the back). False when the
    sample missed a rank (hostile or unlucky columns): the caller selects over the whole column instead."""
    n = bits.shape[0]
    s = max(64, int(n ** (2.0 / 3.0)))
    g = int(3.0 * np.sqrt(s * (k / n) * (1.0 - k / n))) + 2  # margin: ~3 standard deviations of a rank
    lo, hi = (k * s) // n, -(-(n - k) * s // n)
    i1, i2, i3, i4 = lo - g, lo + g, hi - g, hi + g
    two = i2 < i3  # else one bracket holds both ranks (few values kept): keys 2 and 3 stand in for 4 and 1
    sample = np.empty(s, dtype=np.int64)
    for q in range(s):
        sample[q] = _key(bits[(q * n) // s], (q * n) // s)
    k1, k4 = -(2 ** 63), 2 ** 63 - 1  # no key: nothing is surely trimmed on that side
    if i1 >= 0:
        _select_keys(sample, 0, s, i1)  # each key put in place, each selection on what lies above the last
        k1 = sample[i1]
    if two:
        _select_keys(sample, max(i1 + 1, 0), s, i2)
        _select_keys(sample, i2 + 1, s, i3)
        k2, k3 = sample[i2], sample[i3]
    if i4 < s:
        _select_keys(sample, max(i1 + 1, i3 + 1 if two else 0), s, i4)
        k4 = sample[i4]
    if not two:
        k2, k3 = k4, k1
    below, above, m_lo, m_hi = 0, 0, 0, 0
    for i in range(n):  # no branch: which side of a key a value falls is a coin toss to the CPU
        key = _key(bits[i], i)
        under1, upto2, under3, upto4 = np.int64(key < k1), np.int64(key <= k2), np.int64(key < k3), np.int64(key <= k4)
        keep[i] = under3 > upto2
        lower, upper = upto2 - under1, (upto4 - under3) * two
        slot = m_lo + upper * (n - 1 - m_hi - m_lo)  # the next free lower or upper place: m_lo + m_hi <= i < n
        keys[slot] = key
        m_lo += lower
        m_hi += upper
        below += under1
        above += 1 - upto4
    if not two:
        return _keep_one_bracket(keys, k, keep, below, above, m_lo)
    if not (below <= k <= below + m_lo and above <= k <= above + m_hi):
        return False
    t = k - below  # the lower candidates ranked first that are trimmed
    if t < m_lo:
        _select_keys(keys, 0, m_lo, t)
        for q in range(t, m_lo):
            keep[keys[q] & 0xFFFFFFFF] = True
    u = m_hi - (k - above)  # the upper candidates ranked first that are kept
    if u > 0:
        _select_keys(keys, n - m_hi, n, n - m_hi + u - 1)
        for q in range(n - m_hi, n - m_hi + u):
            keep[keys[q] & 0xFFFFFFFF] = True
    return True


@njit(nogil=True, cache=True)
def _keep_one_bracket(keys, k, keep, below, above, m):
    """`_keep_by_sample`'s end when one bracket of m candidate keys (keys[:m]) holds both ranks, `below` values
    surely under it and `above` surely over it: the candidates ranked k - below .. on, n - 2k of them, are kept."""
    n = keep.shape[0]
    if not (below <= k and above <= k):
        return False
    t, last = k - below, k - below + n - 2 * k - 1  # the first and the last kept candidate's places
    if last >= m:
        return False
    _select_keys(keys, 0, m, t)
    _select_keys(keys, t, m, last)
    for q in range(t, last + 1):
        keep[keys[q] & 0xFFFFFFFF] = True
    return True


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
            if k == 0 or n < SAMPLE_MIN or col.itemsize != 4 or not _keep_by_sample(col.view(np.int32), k, keep, r):
                for i in range(n):
                    v[i] = col[i]
                    r[i] = i
                    keep[i] = k == 0
                if k > 0:
                    _select(v, r, 0, n, k)  # positions < k: the k values ranked first
                    _select(v, r, k, n, n - k - 1)  # positions > n-k-1: the k ranked last
                    for q in range(k, n - k):
                        keep[r[q]] = True
            s, sw = 0.0, 0.0  # in row order, without branches: adding 0.0 leaves a sum that starts at +0.0 as it is
            if weighted:
                for i in range(n):
                    kept[i] += keep[i]
                    s += (weights[i] * np.float64(col[i])) * keep[i]
                    sw += weights[i] * keep[i]
            else:
                for i in range(n):
                    kept[i] += keep[i]
                    s += np.float64(col[i]) * keep[i]
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
            trimmed_columns_into(x, 1, weights, 0, 2, np.zeros(2), np.zeros(2), np.zeros(3, dtype=np.int64),
                                 RANK_MAX, *workspace(3, dtype))
