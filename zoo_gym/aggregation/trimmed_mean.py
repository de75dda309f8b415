"""Coordinate-wise trimmed mean (Yin et al. 2018, arXiv:1803.01498).

Per coordinate, drop the k largest and k smallest values and average the rest (with the weights of the
contributors who gave them), k = max(1, floor(beta * n)) whenever beta > 0; beta = 0 is the plain
(weighted) mean. n < 2k + 1 is refused with `NotRobustConfigError`. Copies count once (`groups=`, from
krum.duplicate_groups): a group is one row, its first, with the mean of its members' weights, and n is
the number of groups. Sums are float64, divided once and cast to the deltas' dtype, so the result is
the same on every CPU, BLAS and thread count; columns are sorted a block at a time (`SORT_BYTES`), the same
numbers. Why k >= 1 and copies once: docs/design/aggregation.md.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._checks import check_deltas, check_weights
from .copies import on_members
from .errors import AggregationError, NotRobustConfigError
from .result import AggregateResult, make_diagnostics

# bytes of one sort's values and order: a tensor of many contributors is sorted a column block at a time, so the
# sort's memory stays this, not 16 bytes x contributors x the tensor's elements (figures: CHANGELOG)
SORT_BYTES = 16 << 20


def check_beta(beta: float, *, name: str = "beta") -> None:
    """The one range check of the share trimmed from each end, [0, 0.5); `name`: the setting the message names."""
    if not 0.0 <= beta < 0.5:
        raise AggregationError(f"`{name}` must be in [0, 0.5), got {beta}")


def trim_count(*, n: int, beta: float) -> int:
    """Values trimmed from EACH end of a coordinate: max(1, floor(beta*n)) for beta > 0, else 0."""
    check_beta(beta)
    if beta == 0.0:
        return 0
    k = max(1, math.floor(beta * n))
    if n < 2 * k + 1:
        raise NotRobustConfigError(
            f"trimmed mean with beta={beta} trims {k} value(s) from each end, which needs at least "
            f"{2 * k + 1} contributors; got n={n}. Wait for more contributors or use beta=0 (mean)")
    return k


TRANSPOSE_FROM = 32  # contributors from which a block's columns are made contiguous before the sort


def _sorted_middle(block: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The values of each column of `block` (n, c) ranked k..n-k-1 and their rows, each (n-2k, c), in ascending
    order (stable: equal values by row). From TRANSPOSE_FROM rows on, the columns are copied contiguous and
    sorted along the last dimension, which is faster there (benchmarks/trimmed_sort.py); either way the same
    values and rows, so the same sums."""
    n = block.shape[0]
    if n < TRANSPOSE_FROM:
        values, order = block.sort(dim=0, stable=True)  # (n, c)
        return values[k:n - k], order[k:n - k]
    values, order = block.T.contiguous().sort(dim=1, stable=True)  # (c, n)
    return values[:, k:n - k].T, order[:, k:n - k].T


def trimmed_mean(deltas: Tensor, *, beta: float, weights: Tensor | None = None,
                 groups: Tensor | None = None) -> AggregateResult:
    """Coordinate-wise trimmed mean of `deltas` (n, d) -> (d,), trimming k per end (see module); `groups` (n,)
    names each row's group of copies by its first row (None: every row its own)."""
    deltas = check_deltas(deltas)
    if groups is not None:
        return on_members(deltas, groups, weights,
                          lambda rows, w: trimmed_mean(rows, beta=beta, weights=w))
    n, d = deltas.shape
    k = trim_count(n=n, beta=beta)
    w = check_weights(weights, n=n)  # (n,) float64
    raw = None if weights is None else torch.as_tensor(weights, dtype=torch.float64).flatten()  # (n,) as given
    acc = torch.zeros(d, dtype=torch.float64)  # (d,) float64 sum of the kept values
    denom = None if raw is None else torch.zeros(d, dtype=torch.float64)  # (d,) weight of the kept values
    kept = torch.zeros(n, dtype=torch.int64)  # (n,) values each row kept
    step = max(1, SORT_BYTES // (16 * n))  # columns per sort: a copy, its values and int64 order, 16 bytes an element
    for c0 in range(0, d, step):  # coordinates are independent: the same sums as one sort of all of them
        kept_v, kept_i = _sorted_middle(deltas[:, c0:c0 + step], k)  # (n-2k, c)
        a = acc[c0:c0 + step]
        if raw is None:
            for row in kept_v:
                a += row
        else:
            den = denom[c0:c0 + step]
            for row, who in zip(kept_v, kept_i):
                kw = raw[who]  # (c,) weight of whoever gave each kept value
                a += kw * row  # float64 product, then float64 sum: never an FMA
                den += kw
        kept += torch.bincount(kept_i.flatten(), minlength=n)
    if denom is None:
        agg = acc / (n - 2 * k)
    else:
        if bool((denom <= 0).any()):
            raise AggregationError("every kept value of some coordinate has weight 0; give the "
                                   "contributors positive weights or use beta=0")
        agg = acc / denom
    agg = agg.to(deltas.dtype)
    kept = kept.to(torch.float64)  # (n,)
    return AggregateResult(
        aggregate=agg,
        diagnostics=make_diagnostics(n=n, selected=kept > 0,
                                     weight_used=kept * w / (kept * w).sum(),
                                     trimmed_share=1.0 - kept / d),
    )
