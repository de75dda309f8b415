"""Compiled loops (numba) over dense (n, d) float32 / float64 rows: Krum's distances and the weighted
row sums of `_checks.combine`, each over a range of columns with the GIL released (callers share
column ranges among threads through `packed_kernels.in_group_ranges`).

- `sq_distances`: out[i, j] += sum_c (x_ic - x_jc)^2 for i < j, every difference exact in float64,
  squares summed in float64 (as exact as the torch loop it replaces: non-negative terms, any order).
- `weighted_rows`: out[c] = (sum_q w_q x_{r_q c}) / denom in float64, the terms added in the order
  given, w = 1 added without a product, no fused multiply-add: the very numbers of the torch loop.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["sq_distances", "weighted_rows", "warm_up"]

_COLUMNS_PER_RUN = 2048  # n rows of a run (n x 8 KiB at float32) stay in L1/L2 across the pairs


@njit(nogil=True, cache=True, fastmath={"reassoc", "contract"})
def sq_distances(x, c0, c1, out):
    """out[i, j] += sum over columns c in [c0, c1) of (x[i, c] - x[j, c])^2 in float64, i < j.

    x (n, d) float32 or float64, C-contiguous; out (n, n) float64, upper triangle only. Row i is read
    once for four rows j. The sums are re-associated (vectorised) and may fuse multiply-adds, but
    every difference is exact and every term >= 0: relative error <= (d + 1) 2^-53 per pair.
    """
    n = x.shape[0]
    for r0 in range(c0, c1, _COLUMNS_PER_RUN):
        r1 = min(r0 + _COLUMNS_PER_RUN, c1)
        w = r1 - r0
        for i in range(n - 1):
            xi = x[i, r0:r1]
            j = i + 1
            while j + 3 < n:
                a, b, c, d = x[j, r0:r1], x[j + 1, r0:r1], x[j + 2, r0:r1], x[j + 3, r0:r1]
                s0 = s1 = s2 = s3 = 0.0
                for k in range(w):
                    v = np.float64(xi[k])
                    d0, d1 = v - np.float64(a[k]), v - np.float64(b[k])
                    d2, d3 = v - np.float64(c[k]), v - np.float64(d[k])
                    s0 += d0 * d0
                    s1 += d1 * d1
                    s2 += d2 * d2
                    s3 += d3 * d3
                out[i, j] += s0
                out[i, j + 1] += s1
                out[i, j + 2] += s2
                out[i, j + 3] += s3
                j += 4
            for jj in range(j, n):
                a = x[jj, r0:r1]
                s0 = 0.0
                for k in range(w):
                    d0 = np.float64(xi[k]) - np.float64(a[k])
                    s0 += d0 * d0
                out[i, jj] += s0


@njit(nogil=True, cache=True)
def weighted_rows(x, rows, weights, denom, c0, c1, out):
    """out[c] = (sum over q of weights[q] * x[rows[q], c]) / denom for c in [c0, c1), in float64
    (weights[q] == 1.0: x added as is), then cast to out's dtype. x (n, d); rows int64 (m,);
    weights float64 (m,); out (d,). Strict IEEE order (no fastmath): one rounding per operation."""
    m = rows.shape[0]
    acc = np.empty(_COLUMNS_PER_RUN)
    for r0 in range(c0, c1, _COLUMNS_PER_RUN):  # per column the same operations in the same order,
        w = min(r0 + _COLUMNS_PER_RUN, c1) - r0  # vectorised along the columns of a run
        acc[:w] = 0.0
        for q in range(m):
            xr, wq = x[rows[q], r0:r0 + w], weights[q]
            if wq == 1.0:
                for c in range(w):
                    acc[c] += np.float64(xr[c])
            else:
                for c in range(w):
                    acc[c] += np.float64(xr[c]) * wq
        for c in range(w):
            out[r0 + c] = acc[c] / denom


def warm_up() -> None:
    """Compile (or load from the on-disk cache) the kernels for float32 and float64 rows."""
    for dtype in (np.float32, np.float64):
        x = np.zeros((2, 4), dtype=dtype)
        sq_distances(x, 0, 4, np.zeros((2, 2)))
        weighted_rows(x, np.zeros(1, dtype=np.int64), np.ones(1), 1.0, 0, 4, np.zeros(4, dtype=dtype))
