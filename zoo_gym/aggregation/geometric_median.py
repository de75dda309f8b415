"""Geometric median by smoothed Weiszfeld: RFA (Pillutla, Kakade, Harchaoui 2022, "Robust
Aggregation for Federated Learning", IEEE TSP; arXiv:1912.13445).

Minimises sum_i w_i ||v - x_i|| by v <- sum_i b_i x_i / sum_i b_i, b_i = w_i / max(nu, ||v - x_i||),
starting from the coordinate-wise (lower) median and stopping when the iterate moves by at most `eps` x
the median distance, or after `max_iter` steps. Distances are summed from float64 differences
(`distances.combination_sq_distances`); `weiszfeld` takes them as a callable so `DeltaSoup` streams one
pass per step. Outputs: `score`, each contributor's distance to the median, and `weight_used`, its final
coefficient. Why this start and stop: docs/design/aggregation.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch import Tensor

from ._checks import check_deltas, check_weights, combine64
from .distances import combination_sq_distances, sq_distances_to
from .errors import AggregationError
from .result import AggregateResult, make_diagnostics

# (coefficients or None for the median start, previous coefficients or None) ->
# ((n,) squared distances of the inputs to that iterate, squared distance from the previous one)
DistancesTo = Callable[[Tensor | None, Tensor | None], tuple[Tensor, float]]


def weiszfeld(distances_to: DistancesTo, *, n: int, weights: Tensor | None = None,
              eps: float = 1e-8, max_iter: int = 100, nu: float = 1e-6) -> Tensor:
    """Coefficients a (n,) float64, sum 1, of the smoothed geometric median sum_j a_j x_j.

    Calls `distances_to` at most `max_iter` times (one pass over the data each when streaming).
    """
    if eps < 0 or nu <= 0 or max_iter < 1:
        raise AggregationError(f"need eps >= 0, nu > 0, max_iter >= 1; got eps={eps}, nu={nu}, "
                               f"max_iter={max_iter}")
    w = check_weights(weights, n=n)  # (n,) float64

    def step(sq: Tensor) -> Tensor:
        b = w / sq.sqrt().clamp(min=nu)
        return b / b.sum()

    sq, _ = distances_to(None, None)  # start: coordinate-wise median
    a, previous = step(sq), None
    for _ in range(max_iter - 1):
        sq, move = distances_to(a, previous)
        typical = float(sq.sort().values[(n - 1) // 2])  # lower median squared distance
        if not math.isnan(move) and move <= eps * eps * typical:
            break
        a, previous = step(sq), a
    return a


def geometric_median(deltas: Tensor, *, weights: Tensor | None = None, eps: float = 1e-8,
                     max_iter: int = 100, nu: float = 1e-6) -> AggregateResult:
    """Smoothed geometric median of `deltas` (n, d) -> (d,)."""
    deltas = check_deltas(deltas)
    n = deltas.shape[0]
    a = weiszfeld(lambda c, p: combination_sq_distances(deltas, c, previous=p), n=n,
                  weights=weights, eps=eps, max_iter=max_iter, nu=nu)
    v = combine64(a, deltas)  # (d,) float64
    return AggregateResult(
        aggregate=v.to(deltas.dtype),
        diagnostics=make_diagnostics(n=n, score=sq_distances_to(deltas, v).sqrt(),
                                     selected=a > 0, weight_used=a),
    )
