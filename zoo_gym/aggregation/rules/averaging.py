"""Rules that combine whole deltas with one set of coefficients: the mean (FedAvg, McMahan et al.
2017, arXiv:1602.05629), the geometric median (RFA, Pillutla et al. 2022, arXiv:1912.13445) and
centered clipping (Karimireddy et al. 2021, arXiv:2012.10333). The iterations: geometric_median.py,
centered_clip.py; each iteration is one pass over the model (`RoundView.distances_to`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

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
    """FLTrust's trust (Cao et al. 2021, arXiv:2012.13995) over the fixed-denominator mean. Each delta's trust is
    t_i = clamp(cos(x_i, r) / ramp, 0, 1), r the operator's reference direction (its validation data's descent
    direction): a delta pointing away from r counts for nothing, one within the ramp counts fully (ramp 0: a gate,
    t_i = 1 when cos > 0). In high dimension honest deltas meet r at small angles' cosines (0.05-0.2), so FLTrust's
    weights cos_i themselves would shrink the step by that much under a fixed denominator.
    Under DP: sum_i t_i clip(x_i) / m with the fixed m. t_i depends only on x_i and r, so one person moves the
    release by at most C / m (add/remove) or 2C / m (replace): the mean's bound, which the noise covers (privacy.md).
    Without DP: sum_i t_i s_i x_i / sum_i t_i, each delta first scaled down to the round's median norm
    (s_i = min(1, median / |x_i|)), as FLTrust scales to the reference's norm: a boosted delta along r gains nothing."""

    name = "trust-mean"
    dp_exact = True
    needs_reference = True
    trust_ramp: float = 0.0  # the ramp: a cosine at or above it counts fully

    def __post_init__(self) -> None:
        if not 0.0 <= self.trust_ramp <= 1.0:
            raise AggregationError(f"`trust_ramp` must be in [0, 1], got {self.trust_ramp}")

    def trust(self, cos: Tensor) -> Tensor:
        """(k,) float64 trust in [0, 1] from (k,) cosines with the reference."""
        cos = cos.to(torch.float64)
        if self.trust_ramp == 0.0:
            return (cos > 0).to(torch.float64)
        return (cos / self.trust_ramp).clamp(min=0.0, max=1.0)

    def plan(self, view: RoundView) -> Plan:
        if view.reference_cos is None:
            raise AggregationError("trust-mean needs the reference direction's cosines (DeltaSoup.run(reference=))")
        trust, score = self.trust(view.reference_cos), view.reference_cos.to(torch.float64)
        if view.denominator is not None:
            return LinearPlan(trust, total=view.denominator, score=score, selected=trust > 0)
        total = float(trust.sum())
        if total <= 0:  # nobody points the operator's way: nothing moves
            return LinearPlan(torch.zeros_like(trust), total=1.0, score=score, selected=trust > 0)
        norms = view.norms.to(torch.float64)
        median = float(norms.median())
        scale = torch.where(norms > median, median / torch.where(norms > 0, norms, torch.ones_like(norms)),
                            torch.ones_like(norms))
        return LinearPlan(trust * scale, total=total, score=score, selected=trust > 0, factored=view.factored)


@dataclass(frozen=True, kw_only=True)
class GeometricMedian(Rule):
    """Smoothed Weiszfeld from the coordinate-wise median; copies count once (split weights)."""

    name = "geometric-median"
    needs_distances = True
    counts_copies_once = True
    iterated = True
    gm_eps: float = 1e-8      # stop once the iterate moves less than gm_eps x the median distance to it
    gm_max_iter: int = 32     # Weiszfeld steps at most
    gm_nu: float = 1e-6       # smoothing: distance floor

    def __post_init__(self) -> None:
        if not (self.gm_eps >= 0 and self.gm_nu > 0 and self.gm_max_iter >= 1):
            raise AggregationError(f"`gm_eps` must be >= 0, `gm_nu` > 0 and `gm_max_iter` >= 1; got {self.gm_eps}, "
                                   f"{self.gm_nu}, {self.gm_max_iter}")

    def plan(self, view: RoundView) -> Plan:
        coeff = weiszfeld(view.distances_to, n=view.k, weights=view.split_weights(), eps=self.gm_eps,
                          max_iter=self.gm_max_iter, nu=self.gm_nu)
        return LinearPlan(coeff, iterated=True)


@dataclass(frozen=True, kw_only=True)
class CenteredClip(Rule):
    """Centered clipping around the zero delta; copies count once (split weights)."""

    name = "centered-clip"
    needs_distances = True
    counts_copies_once = True
    iterated = True
    cc_tau: float = 1.0       # clipping radius (whole-delta L2)
    cc_iters: int = 3

    def __post_init__(self) -> None:
        if not self.cc_tau > 0 or self.cc_iters < 1:
            raise AggregationError(f"`cc_tau` must be > 0 and `cc_iters` >= 1, got {self.cc_tau}, {self.cc_iters}")

    def plan(self, view: RoundView) -> Plan:
        # coefficients over [center, x_1..x_k]; the first distances, to the zero center, are the norms
        a, _ = centered_clip_iterate(lambda c: view.distances_to(c[1:], None)[0], view.norms,
                                     tau=self.cc_tau, iters=self.cc_iters, weights=view.split_weights())
        return LinearPlan(a[1:], total=float(a.sum()), iterated=True)  # the center multiplies zero
