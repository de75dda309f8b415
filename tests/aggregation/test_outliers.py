"""Huge but finite outliers (1e3 to 1e30) next to an honest cluster: distances stay exact and every
robust rule keeps its guarantee, dense and through the streamed DeltaSoup pipeline.

The honest cluster: k points c + noise (||noise|| about 1) around a random centre c; h = their
mean, R = max_i ||x_i - h|| (its radius). f outliers s 10^e u (u a random unit vector, s = +-1).
The bounds asserted are guarantees of each rule, not measurements:

* geometric median (Minsker 2015, "Geometric median and robust estimation in Banach spaces",
  Lemma 2.1, Hilbert space): if at most a share alpha = f / n of the points lies outside the ball
  B(h, R), the median lies within C R of h, C = (1 - alpha) / sqrt(1 - 2 alpha) (about 1.09 at
  f = 2, n = 7). We allow 1 % more for stopping Weiszfeld after finitely many iterations.
* centered clipping from `center` v0 with radius tau, uniform weights, outlier weight W = f / n:
  while no honest point is clipped, one iteration maps D = ||v - h|| to at most W D + W tau
  (the honest part averages to h exactly, each outlier moves v by at most its weight x tau).
  So D_T <= W^T D_0 + W tau / (1 - W), and with tau = 2 (R + D_0) no honest point is ever clipped
  (R + max(D_0, W tau / (1 - W)) <= tau because W <= 2/7).
* Krum / Multi-Krum (f = number of outliers): when every outlier is farther from every honest
  point than the honest points are from each other (by the margin checked below), every honest
  Krum score is below every outlier score, so Krum returns an honest point (within R of h) and
  Multi-Krum with m = n - f averages exactly the honest points (h itself).
* Bulyan: the same premise makes every iterated-Krum pick honest, so every coordinate of the
  result lies within the honest points' [min, max] of that coordinate; n < 4f + 3 is refused.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from zoo_gym.aggregation import (DeltaSoup, NotRobustConfigError, SoupConfig, bulyan, centered_clip,
                                 geometric_median, krum, multi_krum, pairwise_sq_distances)
from zoo_gym.aggregation.sources import DictDeltaSource


def _world(seed: int, k: int, f: int, d: int, exponents: list[float], signs: list[int]):
    """(x (k+f, d) float32, honest mean h float64, radius R, centre c float64)."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(d, generator=g, dtype=torch.float64)
    honest = c + torch.randn(k, d, generator=g, dtype=torch.float64) / math.sqrt(d)
    out = []
    for e, s in zip(exponents[:f], signs[:f]):
        u = torch.randn(d, generator=g, dtype=torch.float64)
        out.append(s * 10.0 ** e * u / u.norm())
    x = torch.cat([honest, torch.stack(out)]).to(torch.float32)  # what contributors send
    h_rows = x[:k].double()
    h = h_rows.mean(0)
    radius = float((h_rows - h).norm(dim=1).max())
    return x, h, radius, c


def _reference(x: torch.Tensor) -> torch.Tensor:
    """The slow obvious float64 reference: ((x_i - x_j)^2).sum() for every pair."""
    x = x.double()
    n = x.shape[0]
    return torch.tensor([[float(((x[i] - x[j]) ** 2).sum()) for j in range(n)] for i in range(n)],
                        dtype=torch.float64)


def _krum_premise(x: torch.Tensor, k: int, f: int) -> bool:
    """Every outlier's Krum score exceeds every honest one's (the rule's selection premise)."""
    ref = _reference(x)
    n = k + f
    nearest = n - f - 2
    honest_worst = float(ref[:k, :k].max()) * nearest             # honest score upper bound
    gap = float(ref[k:, :k].min())                                 # outlier to nearest honest
    # an outlier's nearest-neighbour list holds at most f - 1 outliers: at least
    # max(1, nearest - (f - 1)) honest points, each at squared distance >= gap
    return max(1, nearest - (f - 1)) * gap > honest_worst


_worlds = dict(seed=st.integers(0, 2**31 - 1), k=st.integers(5, 8), f=st.integers(1, 2),
               d=st.integers(20, 200),
               exponents=st.lists(st.floats(3.0, 30.0), min_size=2, max_size=2),
               signs=st.lists(st.sampled_from([-1, 1]), min_size=2, max_size=2))


def _gm_bound(k: int, f: int, radius: float) -> float:
    alpha = f / (k + f)
    return (1 - alpha) / math.sqrt(1 - 2 * alpha) * radius * 1.01


def _cc_bound(k: int, f: int, d0: float, tau: float, iters: int) -> float:
    w_out = f / (k + f)
    return w_out ** iters * d0 + w_out * tau / (1 - w_out)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(**_worlds)
def test_distances_exact_and_rules_within_their_bounds_dense(seed, k, f, d, exponents, signs):
    x, h, radius, c = _world(seed, k, f, d, exponents, signs)
    ref = _reference(x)
    got = pairwise_sq_distances(x)
    assert got.diagonal().tolist() == [0.0] * (k + f)
    off = ~torch.eye(k + f, dtype=torch.bool)
    assert float(((got - ref).abs() / ref)[off].max()) <= 1e-12

    gm = geometric_median(x).aggregate.double()
    assert float((gm - h).norm()) <= _gm_bound(k, f, radius)

    d0 = float((c - h).norm())
    tau = 2 * (radius + d0)
    cc = centered_clip(x, tau=tau, center=c.float(), iters=3).aggregate.double()
    assert float((cc - h).norm()) <= _cc_bound(k, f, d0, tau, 3) * (1 + 1e-6) + 1e-4

    assert _krum_premise(x, k, f)
    kr = krum(x, f=f)
    assert int(kr.diagnostics.selected.nonzero()) < k
    assert float((kr.aggregate.double() - h).norm()) <= radius * (1 + 1e-6) + 1e-5
    mk = multi_krum(x, f=f)
    assert mk.diagnostics.selected.tolist() == [True] * k + [False] * f
    assert float((mk.aggregate.double() - h).norm()) <= 1e-5 * (1 + float(h.norm()))

    if k + f < 4 * f + 3:
        with pytest.raises(NotRobustConfigError, match="4f \\+ 3"):
            bulyan(x, f=f)
    else:
        b = bulyan(x, f=f).aggregate.double()
        lo, hi = x[:k].double().min(0).values, x[:k].double().max(0).values
        assert bool(((b >= lo - 1e-5) & (b <= hi + 1e-5)).all())


def _split(x: torch.Tensor) -> list[dict[str, torch.Tensor]]:
    """Each row as two tensors, so the pipeline sums distances over tensors."""
    cut = x.shape[1] // 3
    return [{"a": row[:cut].reshape(1, cut).clone(), "b": row[cut:].clone()} for row in x]


def _soup(x: torch.Tensor, **config) -> tuple[torch.Tensor, object]:
    out: dict[str, torch.Tensor] = {}
    ids = [f"c{i}" for i in range(x.shape[0])]
    config.setdefault("max_norm_ratio", None)  # the rules themselves must cope with the outliers
    report = DeltaSoup(SoupConfig(**config)).run(DictDeltaSource(ids, _split(x)), out.__setitem__)
    return torch.cat([out["a"], out["b"]]).double(), report


@settings(max_examples=25, deadline=None, derandomize=True)
@given(**_worlds)
def test_rules_within_their_bounds_through_the_streamed_pipeline(seed, k, f, d, exponents, signs):
    x, h, radius, _ = _world(seed, k, f, d, exponents, signs)
    assert _krum_premise(x, k, f)

    gm, report = _soup(x, aggregator="geometric-median")
    assert float((gm - h).norm()) <= _gm_bound(k, f, radius)
    scores = torch.tensor([r.score for r in report.contributors], dtype=torch.float64)
    exact = (x.double() - gm).norm(dim=1)  # score: each delta's distance to the published median
    assert torch.allclose(scores, exact, rtol=1e-6, atol=1e-6)

    d0 = float(h.norm())  # the pipeline's centre is the zero delta
    tau = 2 * (radius + d0)
    cc, _ = _soup(x, aggregator="centered-clip", cc_tau=tau, cc_iters=3)
    assert float((cc - h).norm()) <= _cc_bound(k, f, d0, tau, 3) * (1 + 1e-6) + 1e-4
    dense = centered_clip(x, tau=tau, iters=3).aggregate.double()
    assert torch.allclose(cc, dense, rtol=1e-6, atol=1e-5)

    kr, report = _soup(x, aggregator="krum", byzantine_f=f)
    assert [r.selected for r in report.contributors].index(True) < k
    assert float((kr - h).norm()) <= radius * (1 + 1e-6) + 1e-5
    mk, report = _soup(x, aggregator="multi-krum", byzantine_f=f)
    assert [r.selected for r in report.contributors] == [True] * k + [False] * f
    assert float((mk - h).norm()) <= 1e-5 * (1 + float(h.norm()))
    if k + f >= 4 * f + 3:
        b, _ = _soup(x, aggregator="bulyan", byzantine_f=f)
        lo, hi = x[:k].double().min(0).values, x[:k].double().max(0).values
        assert bool(((b >= lo - 1e-5) & (b <= hi + 1e-5)).all())
