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
    """Average of the multi_krum_m lowest-scoring rows (None: rows - byzantine_f), with the round's weights."""

    name = "multi-krum"
    needs_distances = True
    byzantine_f: int = 0             # Byzantine contributors tolerated
    multi_krum_m: int | None = None  # rows averaged

    def __post_init__(self) -> None:
        check_byzantine_f(self.byzantine_f)
        if self.multi_krum_m is not None and self.multi_krum_m < 1:
            raise AggregationError(f"`multi_krum_m` must be >= 1 or None, got {self.multi_krum_m}")

    def check_n(self, n: int) -> None:
        super().check_n(n)
        check_krum_config(n=n, f=self.byzantine_f, rule=self.name)

    def minimum_n(self) -> int:
        return 2 * self.byzantine_f + 3

    def check_round(self, *, submitted: int, accepted: int) -> None:
        self.check_n(accepted)
        if self.multi_krum_m is not None and self.multi_krum_m > accepted:
            raise NotRobustConfigError(f"`multi_krum_m`={self.multi_krum_m} exceeds the {accepted} accepted "
                                       "contributions")

    def per_buffer(self, buffer_size: int) -> dict[str, Any]:
        """`multi_krum_m` per async buffer of K deltas: as configured, else K // 2. Not n - f as in a round: f per
        buffer is the attackers' average share, not a bound (one delta per contributor per buffer, so a buffer can
        hold all of them), and with m = n - f every attacker past K - m is averaged in whatever its score. With
        m = K // 2 none is forced in while they are at most half the buffer (docs/design/async-rounds.md).
        Krum's own bound n >= 2f + 3 keeps K // 2 <= n - f."""
        return {"multi_krum_m": self.multi_krum_m if self.multi_krum_m is not None else max(1, buffer_size // 2)}

    def plan(self, view: RoundView) -> Plan:
        score, coeff = multi_krum_coefficients(view.distances, f=self.byzantine_f, m=self.multi_krum_m,
                                               weights=view.weights)
        return LinearPlan(coeff, score=score, selected=coeff > 0)


@dataclass(frozen=True, kw_only=True)
class Krum(MultiKrum):
    """The single lowest-scoring row: Multi-Krum with multi_krum_m = 1 (not a setting of Krum's)."""

    name = "krum"
    multi_krum_m: int | None = dataclasses.field(default=1, init=False)

    def per_buffer(self, buffer_size: int) -> dict[str, Any]:
        return {}  # one row, per buffer as per round


@dataclass(frozen=True, kw_only=True)
class Bulyan(Rule):
    """Iterated Krum selects n - 2f rows; per coordinate the n - 4f values nearest the median are averaged
    (f: `byzantine_f`)."""

    name = "bulyan"
    needs_distances = True
    byzantine_f: int = 0             # Byzantine contributors tolerated

    def __post_init__(self) -> None:
        check_byzantine_f(self.byzantine_f)

    def check_n(self, n: int) -> None:
        super().check_n(n)
        check_bulyan_config(n=n, f=self.byzantine_f)

    def minimum_n(self) -> int:
        return 4 * self.byzantine_f + 3

    def plan(self, view: RoundView) -> Plan:
        return CoordinatewisePlan(lambda x: bulyan(x, f=self.byzantine_f, distances=view.distances), k=view.k,
                                  selects=True)


def check_byzantine_f(byzantine_f: object) -> None:
    """The one check of `byzantine_f` (Multi-Krum, Krum, Bulyan): an integer >= 0."""
    if not isinstance(byzantine_f, int) or byzantine_f < 0:
        raise AggregationError(f"`byzantine_f` must be an integer >= 0, got {byzantine_f!r}")
