"""Coordinate-wise rules: the median and the trimmed mean (Yin et al. 2018, arXiv:1803.01498).
Copies count once (`groups`, see copies.py). The trimmed mean's n >= 2k + 1 is checked on the
round's submissions: when validation leaves one or two distinct rows they are averaged untrimmed
and the plan's note says so.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..median import median
from ..trimmed_mean import check_beta, trim_count, trimmed_mean
from .base import CoordinatewisePlan, Plan, RoundView, Rule


@dataclass(frozen=True, kw_only=True)
class Median(Rule):
    """Coordinate-wise median (the two middle values averaged for even n)."""

    name = "median"
    needs_distances = True
    counts_copies_once = True
    copies_only = True  # above sketched_copies.EXACT_MAX rows the groups come from a sketch, not k x k distances

    def plan(self, view: RoundView) -> Plan:
        return CoordinatewisePlan(lambda x: median(x, groups=view.groups), k=view.k)


@dataclass(frozen=True, kw_only=True)
class TrimmedMean(Rule):
    """Trim max(1, floor(trim_beta n)) values from each end of every coordinate (trim_beta > 0)."""

    name = "trimmed-mean"
    needs_distances = True
    counts_copies_once = True
    copies_only = True  # above sketched_copies.EXACT_MAX rows the groups come from a sketch, not k x k distances
    trim_beta: float  # share trimmed from each end per coordinate, [0, 0.5); no default here: SoupConfig's is the one

    def __post_init__(self) -> None:
        check_beta(self.trim_beta, name="trim_beta")

    def check_n(self, n: int) -> None:
        super().check_n(n)
        trim_count(n=n, beta=self.trim_beta)

    def minimum_n(self) -> int:
        return 3 if self.trim_beta > 0 else 1

    def check_round(self, *, submitted: int, accepted: int) -> None:
        self.check_n(submitted)  # what validation leaves is averaged (see the module)

    def plan(self, view: RoundView) -> Plan:
        distinct = view.distinct
        beta = self.trim_beta if distinct >= 3 else 0.0
        weights = view.weights if view.weighted else None
        note = ""
        if distinct < 3 and self.trim_beta > 0:
            note = (f"trimmed-mean: validation left {view.k} of {view.submitted} submissions" + (
                    f", {distinct} distinct (copies count once)" if distinct < view.k else "") +
                    "; averaged untrimmed (for two, their coordinate-wise median)")
        return CoordinatewisePlan(
            lambda x: trimmed_mean(x, beta=beta, weights=weights, groups=view.groups), k=view.k, note=note)
