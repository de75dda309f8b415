"""A huge delta in the round (every weight changed by 1e30, accepted under an explicit `mean` with
no norm bound) must not turn the honest contributors' scores or pay to nothing or below: scores
stay finite and >= 0, the huge one earns 0, both honest ones are paid (issue 12 item 5; it used
to give the honest ones marginals of about -1.5e29 and the pool to the huge one)."""

from __future__ import annotations

import math

import pytest
import torch

from zoo_gym.aggregation.sources import DictDeltaSource
from zoo_gym.rewards import (ContributionDiagnostics, FirstOrderConfig, ScoringConfig,
                             SettlementConfig, plan_settlement, score_round,
                             score_round_first_order, streamed_slopes)

BASE_LOSS = 2.0
UNIFORM_LOSS = math.log(256)  # what base + 1e30 everywhere measures: a uniform predictor


def _world(sign: float):
    """Gradient, two honest steps (gains ~0.03, ~0.015) and base + 1e30 x sign on every weight.
    The gradient has a positive mean, so the huge delta is far from a random direction and its
    first-order gain is +-1e30 sum(g) / L0: huge, either sign."""
    gen = torch.Generator().manual_seed(0)
    grad = {"w": torch.randn(40, 100, generator=gen) + 0.5, "b": torch.randn(37, generator=gen) + 0.5}
    honest = [{k: -v / 4000 * s for k, v in grad.items()} for s in (1.0, 0.5)]
    huge = {k: v + sign * 1e30 for k, v in honest[0].items()}
    return grad, [*honest, huge]


def _first_order(grad, deltas, exact_loss):
    ids = ["h0", "h1", "huge"]
    slopes, norms = streamed_slopes(grad, DictDeltaSource(ids, deltas), scales=[1.0] * 3)
    g_norm = math.sqrt(sum(float((v.double() ** 2).sum()) for v in grad.values()))
    numel = sum(v.numel() for v in grad.values())

    def exact(i):
        return exact_loss if i == 2 else BASE_LOSS * (1 + 0.8 * slopes[i] / BASE_LOSS)

    return score_round_first_order(
        ids, base_loss=BASE_LOSS, grad_norm=g_norm, numel=numel, slopes=slopes, norms=norms,
        weights=[1 / 3] * 3, diagnostics=[ContributionDiagnostics()] * 3, config=ScoringConfig(),
        first_order=FirstOrderConfig(), exact_solo_loss=exact)


def _assert_honest_paid(scores):
    s = [x.score for x in scores]
    assert all(math.isfinite(v) and v >= 0 for v in s)
    assert s[2] == 0.0 and min(s[:2]) > 0.0
    assert all(abs(x.marginal) <= 2.0 for x in scores if math.isfinite(x.marginal))
    plan = plan_settlement(round_id=1, scores=scores, reputations={}, pool=1000,
                           config=SettlementConfig())
    paid = {p.contributor: p.amount for p in plan.payouts}
    assert paid["h0"] > 0 and paid["h1"] > 0 and paid["huge"] == 0
    assert all(p.score >= 0 and math.isfinite(p.score) for p in plan.payouts)


@pytest.mark.parametrize("sign", [-1.0, 1.0])  # huge promised gain / huge promised loss
@pytest.mark.parametrize("exact_loss", [UNIFORM_LOSS, math.nan, 2.5])
def test_first_order_scores_survive_a_huge_delta(sign, exact_loss):
    grad, deltas = _world(sign)
    res = _first_order(grad, deltas, exact_loss)
    _assert_honest_paid(res.scores)
    if sign < 0:  # it promised ~1e33 (scored as at most 1) and the exact check refuted it
        assert res.scores[2].solo_gain == 1.0 and "exact check failed" in res.scores[2].reason
        assert "promised gain 9.93e+32" in res.scores[2].reason
    else:
        assert res.scores[2].solo_gain < -1e20 and "did not improve" in res.scores[2].reason
    without = _first_order(grad, deltas[:2] + [{k: torch.zeros_like(v) for k, v in grad.items()}],
                           exact_loss)  # the same honest pair next to a zero delta
    for a, b in zip(res.scores[:2], without.scores[:2]):
        assert 0.5 <= a.score / b.score <= 2.0  # the same order as without the huge one


@pytest.mark.parametrize("huge_loss", [UNIFORM_LOSS, math.nan, math.inf])
def test_exact_scores_survive_a_huge_delta(huge_loss):
    gains = [0.03, 0.015]

    def subset_loss(s):
        if 2 in s:  # the mean with the huge delta in it is broken
            return huge_loss
        return BASE_LOSS * (1 - sum(gains[i] for i in s) / len(s))

    solo = [BASE_LOSS * (1 - g) for g in gains] + [huge_loss]
    ids, ok = ["h0", "h1", "huge"], [ContributionDiagnostics()] * 3
    _assert_honest_paid(score_round(ids, BASE_LOSS, solo, ok, subset_loss, ScoringConfig()))
    # leave-one-out measures each player inside the whole (broken) round, where leaving an
    # honest one out changes nothing: 0 for everybody, but finite and never negative or a crash
    scores = score_round(ids, BASE_LOSS, solo, ok, subset_loss, ScoringConfig(marginal="leave_one_out"))
    assert [s.score for s in scores] == [0.0, 0.0, 0.0]
    assert all(math.isfinite(s.marginal) and abs(s.marginal) <= 2.0 for s in scores)
