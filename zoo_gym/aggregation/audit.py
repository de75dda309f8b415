"""An empirical privacy audit's lower bound on epsilon (Steinke, Nasr, Jagielski 2023, "Privacy Auditing with
One (1) Training Run", arXiv:2305.08846, Theorem 1 with delta = 0).

Canaries are each included with probability 1/2; a distinguisher then guesses, for `guesses` of them, whether
each was in, and `correct` of the guesses are right. For an epsilon-DP mechanism the number right is stochastically
dominated by Binomial(guesses, e^eps / (1 + e^eps)), so every eps under which the observed count would be less
likely than `beta` is refuted: the largest such eps is the audit's lower bound. The same bound holds for many
independent runs with one canary each (the classic audit). Written here because no library on the index
computes it (Opacus accounts, it does not audit); the tail is scipy's binomial survival function.
"""

from __future__ import annotations

import math


def epsilon_lower_bound(*, correct: int, guesses: int, beta: float = 0.05) -> float:
    """The largest epsilon refuted at confidence 1 - beta by `correct` right guesses out of `guesses` (0.0: none)."""
    from scipy.stats import binom

    if not 0 <= correct <= guesses or guesses < 1:
        raise ValueError(f"need 0 <= correct <= guesses and guesses >= 1, got {correct} of {guesses}")

    def tail(eps: float) -> float:  # P[Binomial(guesses, p_eps) >= correct]
        return float(binom.sf(correct - 1, guesses, math.exp(eps) / (1.0 + math.exp(eps))))

    if tail(0.0) >= beta:
        return 0.0
    lo, hi = 0.0, 50.0
    for _ in range(80):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tail(mid) < beta else (lo, mid)
    return lo


def guesses_from_scores(scores, included, *, per_side: int) -> tuple[int, int]:
    """(correct, guesses): guess 'in' for the `per_side` highest scores and 'out' for the lowest, abstain
    on the rest. `scores` and `included` are sequences of equal length (a canary's statistic, whether it was in)."""
    order = sorted(range(len(scores)), key=lambda i: scores[i])
    if not 0 < 2 * per_side <= len(order):
        raise ValueError(f"per_side must be in (0, {len(order) // 2}], got {per_side}")
    right = sum(not included[i] for i in order[:per_side]) + sum(bool(included[i]) for i in order[-per_side:])
    return right, 2 * per_side
