"""Centered clipping (Karimireddy, He, Jaggi 2021, "Learning from History for Byzantine Robust
Optimization", ICML; arXiv:2012.10333).

v <- v + sum_i w_i (x_i - v) min(1, tau / ||x_i - v||), `iters` times, from `center` (the previous
aggregate, or zero when None); a zero distance counts as unclipped. Every iterate is an affine
combination of `center` and the x_i, and its distances are summed from float64 differences
(`distances.combination_sq_distances`). `centered_clip_iterate` takes the distances as a callable
(given for the first iteration, one streamed pass per later one). Outputs: `score`, the distance of
x_i to the final center, and `trimmed_share`, 1 - the last clip factor. Design: docs/design/aggregation.md.
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
