"""Rules that select contributors from whole-model distances: Krum and Multi-Krum (Blanchard et
al. 2017, arXiv:1703.02757) and Bulyan (El Mhamdi et al. 2018, arXiv:1802.07927). The selection
is made once per round from the (k, k) distances (krum.py, bulyan.py); Krum counts copies itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from ..bulyan import bulyan, check_bulyan_config
from ..errors import AggregationError, NotRobustConfigError
from ..krum import check_krum_config, multi_krum_coefficients
from .base import CoordinatewisePlan, LinearPlan, Plan, RoundView, Rule


@dataclass(frozen=True, kw_only=True)
class MultiKrum(Rule):
    """Average of the m lowest-scoring rows (m None: rows - f), with the round's weights."""

    name = "multi-krum"
    needs_distances = True
    f: int = 0             # Byzantine contributors tolerated
    m: int | None = None   # rows averaged

    def __post_init__(self) -> None:
        if not isinstance(self.f, int) or self.f < 0:
            raise AggregationError(f"{type(self).__name__} `f` must be an integer >= 0, got {self.f!r}")
        if self.m is not None and self.m < 1:
            raise AggregationError(f"{type(self).__name__} `m` must be >= 1 or None, got {self.m}")

    @classmethod
    def from_config(cls, config: Any) -> MultiKrum:
        return cls(f=config.byzantine_f, m=config.multi_krum_m)

    def check_n(self, n: int) -> None:
        super().check_n(n)
        check_krum_config(n=n, f=self.f, rule=self.name)

    def minimum_n(self) -> int:
        return 2 * self.f + 3

    def check_round(self, *, submitted: int, accepted: int) -> None:
        self.check_n(accepted)
        if self.m is not None and self.m > accepted:
            raise NotRobustConfigError(f"`multi_krum_m`={self.m} exceeds the {accepted} accepted contributions")

    def plan(self, view: RoundView) -> Plan:
        score, coeff = multi_krum_coefficients(view.distances, f=self.f, m=self.m, weights=view.weights)
        return LinearPlan(coeff, score=score, selected=coeff > 0)


@dataclass(frozen=True, kw_only=True)
class Krum(MultiKrum):
    """The single lowest-scoring row: Multi-Krum with m = 1."""

    name = "krum"
    m: int | None = dataclasses.field(default=1, init=False)

    @classmethod
    def from_config(cls, config: Any) -> Krum:
        return cls(f=config.byzantine_f)


@dataclass(frozen=True, kw_only=True)
class Bulyan(Rule):
    """Iterated Krum selects n - 2f rows; per coordinate the n - 4f values nearest the median are averaged."""

    name = "bulyan"
    needs_distances = True
    f: int = 0             # Byzantine contributors tolerated

    def __post_init__(self) -> None:
        if not isinstance(self.f, int) or self.f < 0:
            raise AggregationError(f"Bulyan `f` must be an integer >= 0, got {self.f!r}")

    @classmethod
    def from_config(cls, config: Any) -> Bulyan:
        return cls(f=config.byzantine_f)

    def check_n(self, n: int) -> None:
        super().check_n(n)
        check_bulyan_config(n=n, f=self.f)

    def minimum_n(self) -> int:
        return 4 * self.f + 3

    def plan(self, view: RoundView) -> Plan:
        return CoordinatewisePlan(lambda x: bulyan(x, f=self.f, distances=view.distances), k=view.k,
                                  selects=True)
