"""Coordinate-wise trimmed mean (Yin et al. 2018, arXiv:1803.01498).

Per coordinate, drop the k largest and k smallest values and average the rest (with the weights of the
contributors who gave them), k = max(1, floor(beta * n)) whenever beta > 0; beta = 0 is the plain
(weighted) mean. n < 2k + 1 is refused with `NotRobustConfigError`. Copies count once (`groups=`, from
krum.duplicate_groups): a group is one row, its first, with the mean of its members' weights, and n is
the number of groups. Sums are float64, divided once and cast to the deltas' dtype, so the result is
the same on every CPU, BLAS and thread count. Why k >= 1 and copies once: docs/design/aggregation.md.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ._checks import check_deltas, check_weights
from .copies import on_members
from .errors import AggregationError, NotRobustConfigError
from .result import AggregateResult, make_diagnostics


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
    values, order = deltas.sort(dim=0, stable=True)  # (n, d)
    kept_v, kept_i = values[k:n - k], order[k:n - k]  # (n-2k, d)
    acc = torch.zeros(d, dtype=torch.float64)  # (d,) float64 sum of the kept values
    if weights is None:
        for row in kept_v:
            acc += row
        agg = acc / (n - 2 * k)
    else:
        raw = torch.as_tensor(weights, dtype=torch.float64).flatten()  # (n,) the caller's weights
        denom = torch.zeros(d, dtype=torch.float64)  # (d,) weight of the kept values
        for row, who in zip(kept_v, kept_i):
            kw = raw[who]  # (d,) weight of whoever gave each kept value
            acc += kw * row  # float64 product, then float64 sum: never an FMA
            denom += kw
        if bool((denom <= 0).any()):
            raise AggregationError("every kept value of some coordinate has weight 0; give the "
                                   "contributors positive weights or use beta=0")
        agg = acc / denom
    agg = agg.to(deltas.dtype)
    kept = torch.bincount(kept_i.flatten(), minlength=n).to(torch.float64)  # (n,)
    return AggregateResult(
        aggregate=agg,
        diagnostics=make_diagnostics(n=n, selected=kept > 0,
                                     weight_used=kept * w / (kept * w).sum(),
                                     trimmed_share=1.0 - kept / d),
    )
