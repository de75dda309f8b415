"""Compiled loops (numba) over dense (n, d) float32 / float64 rows: Krum's distances and the weighted
row sums of `_checks.combine`, each over a range of columns with the GIL released (callers share
column ranges among threads through `packed_kernels.in_group_ranges`).

- `sq_distances`: out[i, j] += sum_c (x_ic - x_jc)^2 for i < j, every difference and square in
  float64 (exact as the column-block torch loop it replaces: non-negative terms, any summation order).
- `weighted_rows`: out[c] = (sum_q w_q x_{r_q c}) / denom in float64, the terms added in the order
  given, w = 1 added without a product, no fused multiply-add: the very numbers of the torch loop.
"""

from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["sq_distances", "weighted_rows", "warm_up"]

_COLUMNS_PER_RUN = 2048  # n rows of a run (n x 8 KiB at float32) stay in L1/L2 across the pairs


@njit(nogil=True, cache=True, fastmath={"reassoc"})
def sq_distances(x, c0, c1, out):
    """out[i, j] += sum over columns c in [c0, c1) of (x[i, c] - x[j, c])^2 in float64, i < j.

    x (n, d) float32 or float64, C-contiguous; out (n, n) float64, upper triangle only. The sums
    are re-associated (vectorised) but every term is >= 0: relative error <= d 2^-53 per pair.
    """
    n = x.shape[0]
    for r0 in range(c0, c1, _COLUMNS_PER_RUN):
        r1 = min(r0 + _COLUMNS_PER_RUN, c1)
        for i in range(n - 1):
            xi = x[i, r0:r1]
            for j in range(i + 1, n):
                xj = x[j, r0:r1]
                acc = 0.0
                for c in range(r1 - r0):
                    diff = np.float64(xi[c]) - np.float64(xj[c])
                    acc += diff * diff
                out[i, j] += acc


@njit(nogil=True, cache=True)
def weighted_rows(x, rows, weights, denom, c0, c1, out):
    """out[c] = (sum over q of weights[q] * x[rows[q], c]) / denom for c in [c0, c1), in float64
    (weights[q] == 1.0: x added as is), then cast to out's dtype. x (n, d); rows int64 (m,);
    weights float64 (m,); out (d,). Strict IEEE order (no fastmath): one rounding per operation."""
    m = rows.shape[0]
    for c in range(c0, c1):
        acc = 0.0
        for q in range(m):
            v = np.float64(x[rows[q], c])
            w = weights[q]
            if w == 1.0:
                acc += v
            else:
                acc += v * w
        out[c] = acc / denom


def warm_up() -> None:
    """Compile (or load from the on-disk cache) the kernels for float32 and float64 rows."""
    for dtype in (np.float32, np.float64):
        x = np.zeros((2, 4), dtype=dtype)
        sq_distances(x, 0, 4, np.zeros((2, 2)))
        weighted_rows(x, np.zeros(1, dtype=np.int64), np.ones(1), 1.0, 0, 4, np.zeros(4, dtype=dtype))
