"""Weighted mean of deltas (FedAvg, McMahan et al. 2017, arXiv:1602.05629).

Weights come from the server (e.g. reputation or a fixed share), never from a contributor's
self-reported sample count: Flower weights by `num_examples`, which an attacker inflates to
take over the average. Not robust: one contributor can move it arbitrarily far.
Accumulated in float64 and divided once (`_checks.combine`): the uniform mean of float32 deltas
is their float64 sum / n rounded once, whatever the CPU, BLAS or thread count.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import check_deltas, check_weights, combine
from .result import AggregateResult, make_diagnostics


def mean(deltas: Tensor, *, weights: Tensor | None = None) -> AggregateResult:
    """Weighted mean of `deltas` (n, d) -> (d,); uniform when `weights` is None."""
    deltas = check_deltas(deltas)
    n = deltas.shape[0]
    w = check_weights(weights, n=n)  # (n,) float64, sums to 1
    # the caller's own weights: float64 products, divided once by their sum (exact for integers)
    raw = w if weights is None else torch.as_tensor(weights, dtype=torch.float64).flatten()
    return AggregateResult(aggregate=combine(raw, deltas),
                           diagnostics=make_diagnostics(n=n, weight_used=w, selected=w > 0))
