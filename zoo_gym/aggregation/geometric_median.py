"""Geometric median by smoothed Weiszfeld: RFA (Pillutla, Kakade, Harchaoui 2022, "Robust
Aggregation for Federated Learning", IEEE TSP; arXiv:1912.13445).

Minimise sum_i w_i ||v - x_i|| by v <- sum_i b_i x_i / sum_i b_i, b_i = w_i / max(nu, ||v - x_i||).
Start at the weighted mean; stop when the objective improves by less than eps (relative) or
after max_iter iterations. The iterate stays a convex combination of the inputs, so the whole
iteration runs on the (n, n) distance matrix (see `span.py`): `geometric_median_coefficients`
is the step the streaming pipeline uses with whole-model distances.
`score` is each contributor's distance to the median; `weight_used` its final coefficient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import check_deltas, check_weights, combine
from .distances import pairwise_sq_distances
from .errors import AggregationError
from .result import AggregateResult, make_diagnostics
from .span import sq_dist_to_combination


def geometric_median_coefficients(distances: Tensor, *, weights: Tensor | None = None,
                                  eps: float = 1e-8, max_iter: int = 100,
                                  nu: float = 1e-6) -> Tensor:
    """Coefficients a (n,) float64, sum 1, with sum_j a_j x_j the smoothed geometric median."""
    if eps < 0 or nu <= 0 or max_iter < 1:
        raise AggregationError(f"need eps >= 0, nu > 0, max_iter >= 1; got eps={eps}, nu={nu}, "
                               f"max_iter={max_iter}")
    dist = torch.as_tensor(distances, dtype=torch.float64)
    n = dist.shape[0]
    w = check_weights(weights, n=n)  # (n,)
    a = w.clone()
    objective = float((w * sq_dist_to_combination(dist, a).sqrt()).sum())
    for _ in range(max_iter):
        r = sq_dist_to_combination(dist, a).sqrt()  # (n,) distances to the current iterate
        b = w / r.clamp(min=nu)
        a = b / b.sum()
        new_objective = float((w * sq_dist_to_combination(dist, a).sqrt()).sum())
        if abs(objective - new_objective) <= eps * max(new_objective, 1e-300):
            break
        objective = new_objective
    return a


def geometric_median(deltas: Tensor, *, weights: Tensor | None = None, eps: float = 1e-8,
                     max_iter: int = 100, nu: float = 1e-6) -> AggregateResult:
    """Smoothed geometric median of `deltas` (n, d) -> (d,)."""
    deltas = check_deltas(deltas)
    n = deltas.shape[0]
    dist = pairwise_sq_distances(deltas)
    a = geometric_median_coefficients(dist, weights=weights, eps=eps, max_iter=max_iter, nu=nu)
    return AggregateResult(
        aggregate=combine(a, deltas),
        diagnostics=make_diagnostics(n=n, score=sq_dist_to_combination(dist, a).sqrt(),
                                     selected=a > 0, weight_used=a),
    )
