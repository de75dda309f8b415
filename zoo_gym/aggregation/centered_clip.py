"""Centered clipping (Karimireddy, He, Jaggi 2021, "Learning from History for Byzantine Robust
Optimization", ICML; arXiv:2012.10333).

v <- v + sum_i w_i (x_i - v) min(1, tau / ||x_i - v||), `iters` times, from `center` (the
previous aggregate, or zero: "no change", when None). Every iterate is an affine combination of
the center and the inputs, so the iteration runs on the (n+1, n+1) distance matrix of
[center, x_1..x_n] (see `span.py`); `centered_clip_coefficients` is the step the streaming
pipeline uses with whole-model distances and norms. A zero distance (x_i == v) counts as
unclipped, not a division by zero. `score` is the distance of x_i to the final center;
`trimmed_share` is 1 - the last clip factor (how much of x_i - v was cut away).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import check_deltas, check_weights
from .distances import pairwise_sq_distances
from .errors import AggregationError
from .result import AggregateResult, make_diagnostics
from .span import sq_dist_to_combination


def centered_clip_coefficients(aug_distances: Tensor, *, tau: float, iters: int = 3,
                               weights: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """From the (n+1, n+1) distances of [center, x_1..x_n]: coefficients (n+1,) summing to 1
    and the last clip factors (n,)."""
    if not tau > 0 or iters < 1:
        raise AggregationError(f"`tau` must be > 0 and `iters` >= 1, got tau={tau}, iters={iters}")
    dist = torch.as_tensor(aug_distances, dtype=torch.float64)
    n = dist.shape[0] - 1
    w = check_weights(weights, n=n)  # (n,)
    a = torch.zeros(n + 1, dtype=torch.float64)
    a[0] = 1.0  # start at the center
    factor = torch.ones(n, dtype=torch.float64)
    for _ in range(iters):
        r = sq_dist_to_combination(dist, a)[1:].sqrt()  # (n,) ||x_i - v||
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
    dist = pairwise_sq_distances(aug)
    a, factor = centered_clip_coefficients(dist, tau=tau, iters=iters, weights=weights)
    return AggregateResult(
        aggregate=a.to(deltas.dtype) @ aug,
        diagnostics=make_diagnostics(n=n, score=sq_dist_to_combination(dist, a)[1:].sqrt(),
                                     weight_used=a[1:], trimmed_share=1.0 - factor),
    )
