"""Coordinate-wise median (Yin et al. 2018, "Byzantine-Robust Distributed Learning: Towards
Optimal Statistical Rates", arXiv:1803.01498).

For even n the median of a coordinate is the average of its two middle values (torch.median
returns the lower one, which is biased). `trimmed_share` of a contributor is the share of
coordinates where its value was not one of the middle value(s). Copies count once (`groups=`, see
trimmed_mean.py): the median of the groups' first rows.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import check_deltas
from .copies import on_members
from .result import AggregateResult, make_diagnostics


def median(deltas: Tensor, *, groups: Tensor | None = None) -> AggregateResult:
    """Coordinate-wise median of `deltas` (n, d) -> (d,); `groups` (n,): copies count once."""
    deltas = check_deltas(deltas)
    if groups is not None:
        return on_members(deltas, groups, None, lambda rows, w: median(rows))
    n, d = deltas.shape
    values, order = deltas.sort(dim=0, stable=True)  # (n, d) each
    lo, hi = (n - 1) // 2, n // 2
    # (d,); the two middle values are averaged in float64 (exact: no overflow near float32's max)
    agg = values[lo] if lo == hi else ((values[lo].double() + values[hi]) / 2).to(deltas.dtype)
    used = torch.zeros(n, dtype=torch.float64)
    mids = (lo,) if lo == hi else (lo, hi)
    for row in mids:
        used += torch.bincount(order[row], minlength=n).to(torch.float64)
    share_used = used / (d * len(mids))  # (n,) share of coordinates each contributor set
    return AggregateResult(
        aggregate=agg,
        diagnostics=make_diagnostics(n=n, selected=used > 0, weight_used=share_used,
                                     trimmed_share=1.0 - used / d),
    )
