"""Result types shared by every aggregator: the aggregate plus per-contributor diagnostics."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .errors import InvalidDeltaError


@dataclass(frozen=True)
class Diagnostics:
    """Per-contributor facts about one aggregation; every field is shaped (n,).

    score:         float64, the aggregator's score (Krum score, distance to the geometric
                   median, ...); nan where the aggregator has no score.
    selected:      bool, whether the contributor influenced the aggregate at all.
    weight_used:   float64, the contributor's effective weight in the aggregate (sums to 1 over
                   contributors for averaging rules; for coordinate-wise rules, the average
                   weight over coordinates).
    trimmed_share: float64 in [0, 1], the share of coordinates where the contributor's value
                   was discarded (trimmed mean, median, Bulyan); 0 or 1 for selection rules.
    """

    score: Tensor
    selected: Tensor
    weight_used: Tensor
    trimmed_share: Tensor

    def __post_init__(self) -> None:
        n = self.score.shape[0]
        for name in ("score", "selected", "weight_used", "trimmed_share"):
            value = getattr(self, name)
            if value.shape != (n,):
                raise InvalidDeltaError(f"Diagnostics.{name} must be shaped ({n},), got "
                                        f"{tuple(value.shape)}")


@dataclass(frozen=True)
class AggregateResult:
    """The aggregate `(d,)` and the per-contributor `Diagnostics`."""

    aggregate: Tensor  # (d,)
    diagnostics: Diagnostics


def make_diagnostics(*, n: int, score: Tensor | None = None, selected: Tensor | None = None,
                     weight_used: Tensor | None = None,
                     trimmed_share: Tensor | None = None) -> Diagnostics:
    """Diagnostics with defaults: no score (nan), everybody selected, uniform weight, nothing trimmed."""
    f64 = torch.float64
    return Diagnostics(
        score=(torch.full((n,), float("nan"), dtype=f64) if score is None
               else score.to(f64)),
        selected=(torch.ones(n, dtype=torch.bool) if selected is None else selected.bool()),
        weight_used=(torch.full((n,), 1.0 / n, dtype=f64) if weight_used is None
                     else weight_used.to(f64)),
        trimmed_share=(torch.zeros(n, dtype=f64) if trimmed_share is None
                       else trimmed_share.to(f64)),
    )
