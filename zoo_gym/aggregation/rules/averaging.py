"""Rules that combine whole deltas with one set of coefficients: the mean (FedAvg, McMahan et al.
2017, arXiv:1602.05629), the geometric median (RFA, Pillutla et al. 2022, arXiv:1912.13445) and
centered clipping (Karimireddy et al. 2021, arXiv:2012.10333). The iterations: geometric_median.py,
centered_clip.py; each iteration is one pass over the model (`RoundView.distances_to`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..centered_clip import centered_clip_iterate
from ..errors import AggregationError
from ..geometric_median import weiszfeld
from .base import LinearPlan, Plan, RoundView, Rule


@dataclass(frozen=True, kw_only=True)
class Mean(Rule):
    """Weighted mean; under DP the sum over a fixed denominator (privacy.py). Not robust."""

    name = "mean"
    staleness_as_weights = True
    dp_exact = True

    def plan(self, view: RoundView) -> Plan:
        if view.denominator is not None:
            return LinearPlan(torch.ones(view.k, dtype=torch.float64), total=view.denominator,
                              factored=view.factored)
        return LinearPlan(view.weights, factored=view.factored)


@dataclass(frozen=True, kw_only=True)
class TrustMean(Rule):
    """FLTrust's trust weights (Cao et al. 2021, arXiv:2012.13995) over the fixed-denominator mean: each clipped
    delta weighs max(0, cos(x_i, r)) in [0, 1], r the operator's reference direction (its validation data's
    descent direction), so a delta pointing away from r counts for nothing. Under DP the weighted sum is divided by
    the fixed m: a weight that depends only on that delta and on r keeps one person's influence within C / m
    (privacy.md), so the mean's noise covers it. Without DP the sum is divided by the weights' sum, as FLTrust."""

    name = "trust-mean"
    dp_exact = True
    needs_reference = True

    def plan(self, view: RoundView) -> Plan:
        if view.reference_cos is None:
            raise AggregationError("trust-mean needs the reference direction's cosines (DeltaSoup.run(reference=))")
        trust = view.reference_cos.clamp(min=0.0, max=1.0).to(torch.float64)
        score = view.reference_cos.to(torch.float64)
        if view.denominator is not None:
            return LinearPlan(trust, total=view.denominator, score=score, selected=trust > 0)
        total = float(trust.sum())
        if total <= 0:  # nobody points the operator's way: nothing moves
            return LinearPlan(torch.zeros_like(trust), total=1.0, score=score, selected=trust > 0)
        return LinearPlan(trust, total=total, score=score, selected=trust > 0, factored=view.factored)


@dataclass(frozen=True, kw_only=True)
class GeometricMedian(Rule):
    """Smoothed Weiszfeld from the coordinate-wise median; copies count once (split weights)."""

    name = "geometric-median"
    needs_distances = True
    counts_copies_once = True
    iterated = True
    eps: float = 1e-8      # stop once the iterate moves less than eps x the median distance to it
    max_iter: int = 32     # Weiszfeld steps at most
    nu: float = 1e-6       # smoothing: distance floor

    def __post_init__(self) -> None:
        if not (self.eps >= 0 and self.nu > 0 and self.max_iter >= 1):
            raise AggregationError(f"GeometricMedian needs eps >= 0, nu > 0, max_iter >= 1; got {self}")

    @classmethod
    def from_config(cls, config: Any) -> GeometricMedian:
        return cls(eps=config.gm_eps, max_iter=config.gm_max_iter, nu=config.gm_nu)

    def plan(self, view: RoundView) -> Plan:
        coeff = weiszfeld(view.distances_to, n=view.k, weights=view.split_weights(), eps=self.eps,
                          max_iter=self.max_iter, nu=self.nu)
        return LinearPlan(coeff, iterated=True)


@dataclass(frozen=True, kw_only=True)
class CenteredClip(Rule):
    """Centered clipping around the zero delta; copies count once (split weights)."""

    name = "centered-clip"
    needs_distances = True
    counts_copies_once = True
    iterated = True
    tau: float = 1.0       # clipping radius (whole-delta L2)
    iters: int = 3

    def __post_init__(self) -> None:
        if not self.tau > 0 or self.iters < 1:
            raise AggregationError(f"CenteredClip needs tau > 0 and iters >= 1; got {self}")

    @classmethod
    def from_config(cls, config: Any) -> CenteredClip:
        return cls(tau=config.cc_tau, iters=config.cc_iters)

    def plan(self, view: RoundView) -> Plan:
        # coefficients over [center, x_1..x_k]; the first distances, to the zero center, are the norms
        a, _ = centered_clip_iterate(lambda c: view.distances_to(c[1:], None)[0], view.norms,
                                     tau=self.tau, iters=self.iters, weights=view.split_weights())
        return LinearPlan(a[1:], total=float(a.sum()), iterated=True)  # the center multiplies zero
