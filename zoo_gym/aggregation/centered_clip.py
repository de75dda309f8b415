"""Centered clipping (Karimireddy, He, Jaggi 2021, "Learning from History for Byzantine Robust
Optimization", ICML; arXiv:2012.10333).

v <- v + sum_i w_i (x_i - v) min(1, tau / ||x_i - v||), `iters` times, from `center` (the
previous aggregate, or zero: "no change", when None). A zero distance (x_i == v) counts as
unclipped, not a division by zero.

Guarantee (uniform weights, outliers' total weight W < 1/2): while no honest point is clipped,
one iteration maps D = ||v - h|| (h the honest points' mean) to at most W D + W tau, since the
honest part averages to h and each outlier moves v by at most its weight x tau. Hence
||v_T - h|| <= W^T ||center - h|| + W tau / (1 - W), however large the outliers are.

Every iterate is an affine combination v = a_0 center + sum_i a_i x_i (coefficients a (n+1,),
summing to 1); the iteration updates a, and each iteration's distances ||x_i - v|| are summed
from float64 differences (`distances.combination_sq_distances`), never derived from the pairwise
distance matrix (that cancels once an outlier's distance is huge and its coefficient tiny).
`centered_clip_iterate` takes the distances as a callable: the first iteration's distances
||x_i - center|| are given (the pipeline has them from validation: its center is the zero delta,
so they are the norms), every later iteration costs one pass over the data when streaming.
`score` is the distance of x_i to the final center; `trimmed_share` is 1 - the last clip factor
(how much of x_i - v was cut away).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from ._checks import check_deltas, check_weights, combine64
from .distances import combination_sq_distances, sq_distances_to
from .errors import AggregationError
from .result import AggregateResult, make_diagnostics


def centered_clip_iterate(distances_to: Callable[[Tensor], Tensor], first: Tensor, *, tau: float,
                          iters: int = 3, weights: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Coefficients a (n+1,) over [center, x_1..x_n] summing to 1, and the last clip factors (n,).

    `first`: (n,) ||x_i - center||; `distances_to(a)`: (n,) float64 SQUARED distances of the x_i
    to a_0 center + sum_i a_i x_i, called `iters - 1` times.
    """
    if not tau > 0 or iters < 1:
        raise AggregationError(f"`tau` must be > 0 and `iters` >= 1, got tau={tau}, iters={iters}")
    n = first.shape[0]
    w = check_weights(weights, n=n)  # (n,)
    a = torch.zeros(n + 1, dtype=torch.float64)
    a[0] = 1.0  # start at the center
    r = first.to(torch.float64)  # (n,) ||x_i - v||
    factor = torch.ones(n, dtype=torch.float64)
    for t in range(iters):
        if t:
            r = distances_to(a).sqrt()
        factor = torch.where(r > tau, tau / r.clamp(min=1e-300), torch.ones_like(r))
        step = w * factor  # (n,) v <- (1 - sum step) v + sum step_i x_i
        a = a * (1.0 - step.sum())
        a[1:] += step
    return a, factor


def centered_clip(deltas: Tensor, *, tau: float, center: Tensor | None = None, iters: int = 3,
                  weights: Tensor | None = None) -> AggregateResult:
    """Centered-clipping aggregate of `deltas` (n, d) -> (d,)."""
    deltas = check_deltas(deltas)
    n, d = deltas.shape
    c = torch.zeros(d, dtype=deltas.dtype) if center is None else center.reshape(d).to(deltas.dtype)
    aug = torch.cat([c[None], deltas])  # (n+1, d)
    a, factor = centered_clip_iterate(lambda coeff: combination_sq_distances(aug, coeff)[0][1:],
                                      sq_distances_to(deltas, c.double()).sqrt(), tau=tau,
                                      iters=iters, weights=weights)
    v = combine64(a, aug)  # (d,) float64
    return AggregateResult(
        aggregate=v.to(deltas.dtype),
        diagnostics=make_diagnostics(n=n, score=sq_distances_to(deltas, v).sqrt(),
                                     weight_used=a[1:], trimmed_share=1.0 - factor),
    )
