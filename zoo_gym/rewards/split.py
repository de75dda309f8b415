"""Splitting an integer reward pool in proportion to weights, exactly.

Largest-remainder (Hamilton) method in exact rational arithmetic (`fractions.Fraction`):
``quota_i = pool * w_i / sum_j w_j``, ``share_i = floor(quota_i) + [i among the R largest remainders]``,
``R = pool - sum_i floor(quota_i)``. Ties go to the smaller contributor id (string order), so the split
is a pure function of (pool, {contributor: weight}). Weight 0 gets 0; when every weight is 0 nobody
gets anything (the sum is 0).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from fractions import Fraction

from .errors import SplitError


def split_pool(pool: int, contributors: Sequence[str], weights: Sequence[float]) -> dict[str, int]:
    """Integer shares of ``pool`` proportional to ``weights``; they sum to ``pool`` exactly
    whenever some weight is positive. Returns ``{contributor: share}`` in the input order."""
    if isinstance(pool, bool) or not isinstance(pool, int) or pool < 0:
        raise SplitError(f"`pool` must be an int >= 0 (integer reward units), got {pool!r}")
    if len(contributors) != len(weights):
        raise SplitError(f"`contributors` ({len(contributors)}) and `weights` ({len(weights)}) "
                         "must have the same length")
    if len(set(contributors)) != len(contributors):
        raise SplitError("`contributors` holds duplicates; merge their weights first")
    exact: list[Fraction] = []
    for who, w in zip(contributors, weights):
        w = float(w)
        if not math.isfinite(w) or w < 0:
            raise SplitError(f"weight of {who!r} must be finite and >= 0, got {w!r}")
        exact.append(Fraction(w))
    total = sum(exact, Fraction(0))
    if total == 0:
        return dict.fromkeys(contributors, 0)
    shares: dict[str, int] = {}
    remainders: list[tuple[Fraction, str]] = []
    for who, w in zip(contributors, exact):
        quota = pool * w / total
        base = quota.numerator // quota.denominator
        shares[who] = base
        if w > 0:
            remainders.append((quota - base, who))
    left = pool - sum(shares.values())
    # Largest remainder first; equal remainders: smaller contributor id first.
    remainders.sort(key=lambda rw: (-rw[0], rw[1]))
    for _, who in remainders[:left]:
        shares[who] += 1
    return shares
