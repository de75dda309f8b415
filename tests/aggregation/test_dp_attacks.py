"""Attacks on the DP release (issue 46): tests that add, remove and replace one contributor and measure how far the
published aggregate moves, and an empirical audit with canaries, instead of recomputing the formula.

Each test runs the real DeltaSoup. The same noise seed on two neighbouring cohorts gives the same noise, so the
difference of the two releases is the difference of what the rule computed: the move the noise must cover.
Both attacks are also run against the trimmed mean with the mean's noise (what the server ran before): they must
find it out, so that they could fail.
"""

from __future__ import annotations

import math

import pytest
import torch

from zoo_gym.aggregation import AGGREGATORS, DeltaSoup, NotRobustConfigError, SoupConfig, SoupConfigError
from zoo_gym.aggregation.audit import epsilon_lower_bound, guesses_from_scores
from zoo_gym.aggregation.clipping import adaptive_clip_update
from zoo_gym.aggregation.config import DP_AGGREGATORS
from zoo_gym.aggregation.privacy import epsilon
from zoo_gym.aggregation.sources import DictDeltaSource

C, DELTA = 1.0, 1e-5


def _release(cfg: SoupConfig, rows: list[torch.Tensor], *, seed: int = 7) -> tuple[torch.Tensor, object]:
    """The published aggregate of `rows` (each one contributor's whole delta, split over two tensors); the
    operator's reference direction (trust-mean) is a fixed direction of its own."""
    out: dict[str, torch.Tensor] = {}
    deltas = [{"a": r[:5], "b": r[5:]} for r in rows]
    ref = torch.linspace(-1.0, 2.0, rows[0].numel(), dtype=torch.float32)
    report = DeltaSoup(cfg).run(DictDeltaSource([f"c{i}" for i in range(len(rows))], deltas), out.__setitem__,
                                generator=torch.Generator().manual_seed(seed), reference={"a": ref[:5], "b": ref[5:]})
    return torch.cat([out["a"], out["b"]]).double(), report


def _cohort(g: torch.Generator, k: int, d: int) -> list[torch.Tensor]:
    """k deltas of mixed norms: most under C, some far over it, one a copy of another, one zero."""
    rows = [torch.randn(d, generator=g) * float(torch.empty(1).exponential_(generator=g)) for _ in range(k)]
    if k >= 3:
        rows[1] = rows[0].clone()
        rows[2] = torch.zeros(d)
    return rows


def _candidates(g: torch.Generator, rows: list[torch.Tensor], d: int) -> list[torch.Tensor]:
    """Contributions an attacker would add: against the aggregate, huge, tiny, aligned with one coordinate,
    a copy of someone, and not finite (refused by validation: it must move nothing)."""
    total = torch.stack(rows).sum(0) if rows else torch.ones(d)
    e0 = torch.zeros(d)
    e0[0] = 1.0
    ref = torch.linspace(-1.0, 2.0, d)
    out = [-total * 1e3, total * 1e6, torch.randn(d, generator=g) * 1e-4, e0 * 50, torch.randn(d, generator=g) * 5,
           ref * 7, -ref]  # along the operator's direction (full trust) and against it
    if rows:
        out.append(rows[0].clone())
    out.append(torch.full((d,), float("nan")))
    return out


def _neighbours(rows: list[torch.Tensor], x: torch.Tensor, *, replace: bool):
    """(D, D') pairs differing in one person: x added, someone removed, and (replace) someone replaced by x."""
    yield rows, rows + [x]
    for i in range(len(rows)):
        if len(rows) > 1:
            yield rows, rows[:i] + rows[i + 1:]
        if replace:
            yield rows, rows[:i] + [x] + rows[i + 1:]


def _largest_move(make_cfg, *, replace: bool, seeds: range, d: int = 12) -> tuple[float, object]:
    """The largest ||A(D') - A(D)|| over random and worst-case cohorts and neighbours, with a report of D."""
    worst, report = 0.0, None
    for seed in seeds:
        g = torch.Generator().manual_seed(seed)
        rows = _cohort(g, 1 + seed % 8, d)
        released = {}  # each cohort's release once: D is the same for every candidate, and so is D minus one
        for x in _candidates(g, rows, d):
            for a, b in _neighbours(rows, x, replace=replace):
                cfg = make_cfg(len(a), len(b))
                if cfg is None:
                    continue
                for cohort in (a, b):
                    key = tuple(id(r) for r in cohort)
                    if key not in released:
                        try:
                            released[key] = _release(cfg, cohort)
                        except NotRobustConfigError:  # nothing accepted (all refused): nothing published
                            released[key] = None
                pa, pb = released[tuple(map(id, a))], released[tuple(map(id, b))]
                if pa is None or pb is None:
                    continue
                (ra, report), (rb, _) = pa, pb
                worst = max(worst, float((rb - ra).norm()))
    return worst, report


@pytest.mark.parametrize("rule", DP_AGGREGATORS)
@pytest.mark.parametrize("participation", ["public", "private"])
def test_no_neighbour_moves_a_dp_release_beyond_the_sensitivity_its_noise_assumes(rule, participation):
    m = 6  # fixed before any submission: cohorts of 1 to 10 (below and above m) against the same m

    def cfg(*_):
        return SoupConfig(aggregator=rule, dp_noise_multiplier=1.0, dp_clip=C, dp_expected_contributors=m,
                          dp_participation=participation)

    worst, report = _largest_move(cfg, replace=participation == "public", seeds=range(16))
    priv = report.privacy
    assumed = report.noise_std / priv.accounted_noise_multiplier  # the sensitivity the accountant charges
    assert assumed == pytest.approx((2 if participation == "public" else 1) * C / m)
    assert worst <= assumed * (1 + 1e-5), f"one person moved the release {worst / (C / m):.3f} x C/m"
    # the search reaches the bound, so it is not vacuous: the mean's is tight; trust-mean's add-one bound C / m is
    # (a delta along the reference counts fully), its replace-one move stays under the 2C / m charged for it
    assert worst >= 0.99 * (assumed if rule == "mean" else C / m)


def test_the_same_search_finds_the_trimmed_mean_beyond_the_means_bound():
    """What the server ran before: the trimmed mean (beta 0.4) of clipped deltas with noise for C / m."""
    def cfg(n_a, n_b):
        return SoupConfig(aggregator="trimmed-mean", dp_clip=C, min_contributors=1) if min(n_a, n_b) >= 3 else None

    worst, _ = _largest_move(cfg, replace=False, seeds=range(16))
    worst_ratio = max(worst * n / C for n in (3, 10))  # against the C / m the mean's noise would assume
    assert worst_ratio > 2.0, f"the search found only {worst_ratio:.2f} x C/m on the trimmed mean"


@pytest.mark.parametrize("rule", [r for r in AGGREGATORS if r not in DP_AGGREGATORS])
def test_dp_with_a_rule_without_a_proven_bound_is_refused_naming_what_is_allowed(rule):
    with pytest.raises(SoupConfigError, match="`aggregator` must be mean or trust-mean"):
        SoupConfig(aggregator=rule, byzantine_f=1, dp_noise_multiplier=1.0, dp_clip=C, dp_expected_contributors=5)


def test_dp_without_a_fixed_denominator_is_refused():
    with pytest.raises(SoupConfigError, match="dp_expected_contributors"):
        SoupConfig(aggregator="mean", dp_noise_multiplier=1.0, dp_clip=C)


def test_one_run_canary_audit_stays_below_the_reported_epsilon():
    """Steinke, Nasr, Jagielski 2023: 1000 canaries of norm C on their own coordinates, each in with probability
    1/2, beside 20 ordinary deltas, in ONE release; guess in for the 100 highest coordinates, out for the 100
    lowest. The audit finds some privacy loss (it has power) and never more than the epsilon reported."""
    g = torch.Generator().manual_seed(2026)
    canaries, ordinary, z = 1000, 20, 2.0
    d = canaries + 40
    included = (torch.rand(canaries, generator=g) < 0.5).tolist()
    rows = [torch.cat([torch.zeros(canaries), torch.randn(40, generator=g)]) for _ in range(ordinary)]
    for i, inside in enumerate(included):
        if inside:
            row = torch.zeros(d)
            row[i] = C
            rows.append(row)
    m = ordinary + canaries // 2
    cfg = SoupConfig(aggregator="mean", dp_noise_multiplier=z, dp_clip=C, dp_expected_contributors=m,
                     dp_participation="private")
    released, report = _release(cfg, rows, seed=11)
    right, guesses = guesses_from_scores(released[:canaries].tolist(), included, per_side=100)
    lower = epsilon_lower_bound(correct=right, guesses=guesses)
    reported = report.privacy.epsilon_total
    assert reported == pytest.approx(epsilon([(z, 1.0, 1)], delta=DELTA))
    assert 0 < lower <= reported, f"audit {lower:.3f} against reported {reported:.3f}"


def test_canary_audit_exceeds_the_epsilon_once_reported_for_the_trimmed_mean():
    """4000 runs, a canary in each with probability 1/2, on the cohort that the trimmed mean amplifies most
    (5 deltas at -v and 5 at +v on every coordinate; the canary at +v): the release the server once made (the
    trimmed mean of clipped deltas plus the mean's noise z C / m) is audited above the epsilon it reported."""
    d, z, m, trials = 16, 2.0, 10, 4000
    v = C / math.sqrt(d)
    g = torch.Generator().manual_seed(4)
    jitter = [1e-3 * v * torch.randn(d, generator=g) for _ in range(10)]  # distinct: copies would count once
    cohort = [torch.full((d,), -v) + j for j in jitter[:5]] + [torch.full((d,), v) + j for j in jitter[5:]]
    cfg = SoupConfig(aggregator="trimmed-mean", trim_beta=0.4, dp_clip=C)  # the rule; its noise comes below
    without, _ = _release(cfg, cohort)
    with_canary, _ = _release(cfg, cohort + [torch.full((d,), v)])
    included = (torch.rand(trials, generator=g) < 0.5)
    noise = torch.randn(trials, d, generator=g, dtype=torch.float64) * (z * C / m)
    released = torch.where(included[:, None], with_canary, without) + noise
    scores = (released.sum(1) / math.sqrt(d)).tolist()
    right, guesses = guesses_from_scores(scores, included.tolist(), per_side=100)
    lower = epsilon_lower_bound(correct=right, guesses=guesses)
    reported = epsilon([(z, 1.0, 1)], delta=DELTA)
    assert lower > reported, f"audit {lower:.3f} did not exceed the reported {reported:.3f}"


def test_adaptive_clipping_count_moves_by_half_when_one_person_is_added():
    """The noised count's budget assumes sensitivity 1/2 (Andrew et al.): adding one person, clipped or not,
    moves the estimated unclipped share by at most 1/(2m) (an uncentred count moves it by 1/m)."""
    m, lr, gamma = 20, 0.2, 0.5
    g = torch.Generator().manual_seed(0)
    norms = torch.rand(m, generator=g) * 2

    def share(ns: torch.Tensor) -> float:
        nxt = adaptive_clip_update(ns, clip=C, target_quantile=gamma, lr=lr, count_stddev=1.0,
                                   expected_contributors=m, generator=torch.Generator().manual_seed(3))
        return gamma - math.log(nxt / C) / lr

    base = share(norms)
    for added in (0.0, 0.5, 5.0):  # under the clip, or over it
        moved = abs(share(torch.cat([norms, torch.tensor([added])])) - base)
        assert moved == pytest.approx(0.5 / m, rel=1e-9)
