"""Coordinate-wise trimmed mean (Yin et al. 2018, arXiv:1803.01498).

Per coordinate, drop the k largest and k smallest values and average the rest (with the weights of the
contributors who gave them), k = max(1, floor(beta * n)) whenever beta > 0; beta = 0 is the plain
(weighted) mean. n < 2k + 1 is refused with `NotRobustConfigError`. Copies count once (`groups=`, from
krum.duplicate_groups): a group is one row, its first, with the mean of its members' weights, and n is
the number of groups. Each coordinate's kept values are selected, not sorted, and summed in float64 by a
compiled kernel (select_kernels.py: ties go by row, as a stable sort's would), divided once and cast to the
deltas' dtype: the same result on every CPU and thread count, no buffer beyond a few columns. Why k >= 1 and
copies once: docs/design/aggregation.md.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from . import select_kernels
from ._checks import check_deltas, check_weights
from .copies import on_members
from .errors import AggregationError, NotRobustConfigError
from .packed_kernels import in_chunks
from .result import AggregateResult, make_diagnostics

_MIN_VALUES_PER_CHUNK = 1 << 20  # values ranked: below this a thread costs more than it saves


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
    deltas = check_deltas(deltas, finite=False)  # the kernel checks the values it ranks
    if groups is not None:
        if torch.unique(torch.as_tensor(groups)).numel() < deltas.shape[0]:
            check_deltas(deltas)  # copies present: the kernel below reads one row of each group
        return on_members(deltas, groups, weights,
                          lambda rows, w: trimmed_mean(rows, beta=beta, weights=w))
    n, d = deltas.shape
    k = trim_count(n=n, beta=beta)
    w = check_weights(weights, n=n)  # (n,) float64
    raw = None if weights is None else torch.as_tensor(weights, dtype=torch.float64).flatten()  # (n,) as given
    x = deltas.detach().cpu()
    x = x if x.dtype in (torch.float32, torch.float64) else x.to(torch.float32)  # exact for fp16 / bf16
    xs = (x if x.is_contiguous() else x.contiguous()).numpy()
    acc = np.zeros(d)  # (d,) float64 sum of the kept values
    den = np.zeros(d if raw is not None else 0)  # (d,) weight of the kept values
    ws = np.zeros(0) if raw is None else raw.numpy()

    def columns(c0: int, c1: int) -> tuple[int, np.ndarray]:
        kept_here = np.zeros(n, dtype=np.int64)
        return select_kernels.trimmed_columns_into(xs, k, ws, c0, c1, acc, den, kept_here, select_kernels.RANK_MAX,
                                                   *select_kernels.workspace(n, xs.dtype)), kept_here

    parts = in_chunks(columns, d, min_chunk=_MIN_VALUES_PER_CHUNK // n)
    if sum(bad for bad, _ in parts):
        check_deltas(deltas)  # raises, naming the rows with NaN or inf
    kept = torch.from_numpy(sum(part for _, part in parts))  # (n,) values each row kept
    acc = torch.from_numpy(acc)
    denom = None if raw is None else torch.from_numpy(den)
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
