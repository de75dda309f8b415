"""Marginal effect of each contributor on the merged model: leave-one-out and GTG-Shapley.

Players are the round's validated submissions; V(S) = (L0 - L(S)) / L0, V(empty) = 0, clamped to
[-1, 1] (a non-finite loss counts as -1). ``L(S)`` is the server's ``subset_loss(S)``, one forward pass
per call: both estimators cache by coalition and never exceed ``max_evaluations``. Leave-one-out:
``V(N) - V(N \\ {i})``, n + 1 evaluations. GTG-Shapley (Liu, Chen, Zhou, Yu, Yang, Hsu, ACM TIST 2022,
arXiv:2109.02053): Monte-Carlo permutations with guided sampling, within- and between-round truncation
and a convergence test; a permutation cut off by the budget is discarded. When ``subset_loss`` returns one loss
per scoring example (exact match's 0-1 losses), both also give each value's standard error over the examples
(``MarginalEstimate.errors``: the per-example marginals' spread, as the values are their mean).
Details: docs/design/rewards-scoring.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING


from .errors import ScoringInputError

if TYPE_CHECKING:  # torch is imported where it is used: the configs load without it
    import torch

SubsetLoss = Callable[[frozenset[int]], "float | torch.Tensor"]  # a mean loss, or (examples,) per-example losses


class _BudgetExhausted(Exception):
    """Internal: the next evaluation would exceed `max_evaluations`."""


class CachedValue:
    """``V(S)`` over a budgeted, cached ``subset_loss``; ``evaluations`` counts real calls. When ``subset_loss``
    returns per-example losses (and ``base_losses`` gives the base's), ``per_example(S)`` is ``V`` per example,
    ``(L0 - l_q(S)) / L0``, whose mean is ``V(S)`` before its clamp."""

    def __init__(self, subset_loss: SubsetLoss, *, base_loss: float, max_evaluations: int,
                 base_losses: torch.Tensor | None = None) -> None:
        if not (math.isfinite(base_loss) and base_loss > 0):
            raise ScoringInputError(f"`base_loss` must be finite and > 0 (a cross-entropy), "
                                    f"got {base_loss!r}")
        self._subset_loss = subset_loss
        self._base_loss = float(base_loss)
        self._max = int(max_evaluations)
        self._cache: dict[frozenset[int], float] = {frozenset(): 0.0}
        self._per: dict[frozenset[int], torch.Tensor] = {}
        if base_losses is not None:
            self._per[frozenset()] = (self._base_loss - base_losses.double()) / self._base_loss
        self.evaluations = 0

    def remaining(self) -> int:
        return self._max - self.evaluations

    def cached(self, subset: frozenset[int]) -> bool:
        return subset in self._cache

    def __call__(self, subset: frozenset[int]) -> float:
        hit = self._cache.get(subset)
        if hit is not None:
            return hit
        if self.evaluations >= self._max:
            raise _BudgetExhausted
        out = self._subset_loss(subset)
        self.evaluations += 1
        if getattr(out, "ndim", 0) == 1:  # per-example losses: the value's spread over the scoring examples
            self._per[subset] = (self._base_loss - out.double()) / self._base_loss
            out = out.double().mean()
        loss = float(out)
        value = (self._base_loss - loss) / self._base_loss if math.isfinite(loss) else -1.0
        value = min(1.0, max(-1.0, value))  # see the module docstring
        self._cache[subset] = value
        return value

    def per_example(self, subset: frozenset[int]) -> torch.Tensor | None:
        """``V(S)`` per scoring example (float64), or None when ``subset_loss`` gave only a mean."""
        return self._per.get(subset)


def standard_error(per_example: torch.Tensor) -> float:
    """Standard error of the mean of per-example values (their sample standard deviation / sqrt(n))."""
    n = int(per_example.numel())
    return float(per_example.std() / math.sqrt(n)) if n > 1 else math.inf


@dataclass(frozen=True)
class MarginalEstimate:
    """Per-player marginal values (relative loss gain) and what they cost."""

    values: dict[int, float]   # player index -> phi_i (or m_i for leave-one-out)
    method: str                # "leave_one_out" | "gtg_shapley" | "none"
    evaluations: int           # distinct `subset_loss` calls
    permutations: int = 0      # complete permutations averaged (GTG-Shapley)
    note: str = ""             # why a cheaper method was used, if it was
    errors: dict[int, float] | None = None  # each value's standard error over the scoring examples, if measured


def leave_one_out(players: Sequence[int], value: CachedValue) -> MarginalEstimate | None:
    """``m_i = V(N) - V(N \\ {i})``; None when the budget cannot pay the ``n + 1`` evaluations."""
    full = frozenset(players)
    needed = sum(not value.cached(s) for s in [full, *(full - {i} for i in players)])
    if needed > value.remaining():
        return None
    v_full = value(full)
    values = {i: v_full - value(full - {i}) for i in players}
    errors = None
    if value.per_example(full) is not None:  # the gain per example is paired: its spread is the value's error
        errors = {i: standard_error(value.per_example(full) - value.per_example(full - {i})) for i in players}
    return MarginalEstimate(values=values, method="leave_one_out", evaluations=value.evaluations, errors=errors)


def gtg_shapley(players: Sequence[int], value: CachedValue, *, max_permutations: int,
                truncation_tol: float, between_tol: float, convergence_tol: float,
                generator: torch.Generator) -> MarginalEstimate | None:
    """GTG-Shapley estimate of ``phi_i``; None when not even one permutation fits the budget."""
    import torch

    n = len(players)
    if n == 0:
        return MarginalEstimate(values={}, method="gtg_shapley", evaluations=0)
    full = frozenset(players)
    try:
        v_full = value(full)
    except _BudgetExhausted:
        return None
    if abs(v_full) <= between_tol:  # between-round truncation: nothing to share
        return MarginalEstimate(values={i: 0.0 for i in players}, method="gtg_shapley",
                                evaluations=value.evaluations)
    sums = dict.fromkeys(players, 0.0)
    done = 0
    previous: dict[int, float] | None = None
    steps: list[tuple[int, frozenset[int], frozenset[int]]] = []  # (player, coalition before, after) taken
    for k in range(max_permutations):
        lead = players[k % n]
        rest = [p for p in players if p != lead]
        order = [lead] + [rest[j] for j in torch.randperm(n - 1, generator=generator).tolist()]
        marginals: dict[int, float] = {}
        taken: list[tuple[int, frozenset[int], frozenset[int]]] = []
        prefix: frozenset[int] = frozenset()
        v_prev = 0.0
        try:
            for p in order:
                if abs(v_full - v_prev) <= truncation_tol * abs(v_full):
                    marginals[p] = 0.0  # within-round truncation
                    continue
                taken.append((p, prefix, prefix | {p}))
                prefix = prefix | {p}
                v_new = value(prefix)
                marginals[p] = v_new - v_prev
                v_prev = v_new
        except _BudgetExhausted:
            break
        done += 1
        steps += taken
        for p, m in marginals.items():
            sums[p] += m
        current = {p: s / done for p, s in sums.items()}
        if previous is not None and done >= n:
            change = sum(abs(current[p] - previous[p]) / max(abs(current[p]), 1e-12)
                         for p in players) / n
            if change < convergence_tol:
                break
        previous = current
    if done == 0:
        return None
    return MarginalEstimate(values={p: s / done for p, s in sums.items()}, method="gtg_shapley",
                            evaluations=value.evaluations, permutations=done,
                            errors=_shapley_errors(value, players, steps, done))


def _shapley_errors(value: CachedValue, players: Sequence[int], steps, done: int) -> dict[int, float] | None:
    """Each Shapley estimate's standard error over the scoring examples: the estimate is the mean over examples
    of the same permutations' marginals per example (a truncated step adds 0 to both), so their spread is its
    error for this draw of examples. None without per-example values. The permutations' own sampling error is
    not in it (their number is bounded by the budget and the convergence test)."""
    if value.per_example(frozenset()) is None:
        return None
    per_player = dict.fromkeys(players, 0.0)
    for p, before, after in steps:
        a, b = value.per_example(after), value.per_example(before)
        if a is None or b is None:
            return None
        per_player[p] = per_player[p] + (a - b)
    return {p: 0.0 if isinstance(v, float) else standard_error(v / done) for p, v in per_player.items()}
