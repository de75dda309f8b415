"""Server-side contributor weights with a cap on any one share.

Weights are never a contributor's own claim (Flower's `num_examples` can be inflated at will);
the server passes them (reputation, fixed shares). `cap_weights` additionally bounds any one
contributor's share by water-filling: shares above the cap are set to it and the rest is
re-spread over the others in proportion to their weights.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import check_weights
from .errors import AggregationError


def cap_weights(weights: Tensor | None, *, n: int, max_share: float | None) -> Tensor:
    """(n,) float64 shares summing to 1, none above `max_share` (None: no cap)."""
    w = check_weights(weights, n=n)
    if max_share is None:
        return w
    if max_share * n < 1.0 - 1e-12:
        raise AggregationError(f"`max_weight_share`={max_share} is below 1/n = {1 / n:.4g}; "
                               "shares cannot sum to 1")
    capped = torch.zeros(n, dtype=torch.bool)
    for _ in range(n):
        free = 1.0 - max_share * float(capped.sum())
        rest = torch.where(capped, torch.zeros_like(w), w)
        out = torch.where(capped, torch.full_like(w, max_share), rest / rest.sum() * free)
        over = (out > max_share + 1e-15) & ~capped
        if not bool(over.any()):
            return out
        capped |= over
    return out
