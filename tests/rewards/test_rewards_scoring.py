"""score_round and its marginal estimators on hand-made games with exact expected numbers."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zoo_gym.rewards import (ConfigError, ContributionDiagnostics, ScoringConfig,
                             ScoringInputError, score_round, score_round_detailed)

OK = ContributionDiagnostics()


def additive_loss(base: float, gains: list[float]):
    """subset_loss of an additive game: each player lowers the loss by its own amount."""
    calls: list[frozenset[int]] = []

    def subset_loss(s: frozenset[int]) -> float:
        calls.append(s)
        return base - sum(gains[i] for i in s)

    return subset_loss, calls


def test_hand_computed_scores_leave_one_out():
    # base 2.0; solo losses 1.8 (g = 0.1), 2.0 (g = 0), 2.2 (g = -0.1).
    # Additive game: V(S) = sum of (0.2, 0.0, -0.2)[i] / 2 -> m = 0.1, 0, -0.1.
    subset_loss, calls = additive_loss(2.0, [0.2, 0.0, -0.2])
    scores = score_round(["h", "free", "flip"], 2.0, [1.8, 2.0, 2.2], [OK, OK, OK], subset_loss,
                         ScoringConfig(marginal="leave_one_out"))
    assert [s.score for s in scores] == pytest.approx([0.1, 0.0, 0.0], abs=1e-15)
    assert scores[0].solo_gain == pytest.approx(0.1)
    assert scores[0].marginal == pytest.approx(0.1)
    assert scores[2].marginal == pytest.approx(-0.1)
    assert "did not improve" in scores[1].reason and "did not improve" in scores[2].reason
    assert len(calls) == 4 and frozenset() not in calls  # N and the three N \ {i}


def test_gtg_shapley_is_exact_on_an_additive_game():
    gains = [0.3, 0.1, 0.0, -0.2]
    subset_loss, calls = additive_loss(1.0, gains)
    cfg = ScoringConfig(marginal="gtg_shapley", truncation_tol=0.0, max_evaluations=100,
                        max_permutations=8)
    res = score_round_detailed(list("abcd"), 1.0, [1 - g for g in gains], [OK] * 4, subset_loss,
                               cfg)
    assert [res.estimate.values[i] for i in range(4)] == pytest.approx(gains, abs=1e-12)
    assert res.estimate.method == "gtg_shapley"
    assert res.estimate.evaluations == len(set(calls)) <= 100
    # a: sqrt(0.3 * 0.3) = 0.3; b: 0.1; c and d get nothing.
    assert [s.score for s in res.scores] == pytest.approx([0.3, 0.1, 0.0, 0.0], abs=1e-12)


def test_diagnostics_shrink_the_score_exactly():
    subset_loss, _ = additive_loss(1.0, [0.1, 0.1, 0.1, 0.1])
    diags = [
        ContributionDiagnostics(krum_score=1.0),
        ContributionDiagnostics(clip_factor=0.25, krum_score=2.0),          # sqrt(0.25) = 0.5
        ContributionDiagnostics(trimmed_share=0.5, krum_score=4.0),         # (1-0.5) x (2/4)
        ContributionDiagnostics(selected=False, krum_score=8.0),            # not selected
    ]
    # median Krum score over the four = (2 + 4) / 2 = 3 -> consensus 1, 1, 3/4, 3/8.
    scores = score_round(list("abcd"), 1.0, [0.9] * 4, diags, subset_loss,
                         ScoringConfig(marginal="leave_one_out"))
    assert [s.consensus for s in scores] == pytest.approx([1.0, 1.0, 0.75, 0.375])
    assert [s.participation for s in scores] == pytest.approx([1.0, 0.5, 0.5, 0.0])
    assert [s.score for s in scores] == pytest.approx([0.1, 0.05, 0.0375, 0.0])
    assert scores[3].reason == "not selected by the robust aggregator"


def test_refused_submission_scores_zero_and_is_not_a_player():
    subset_loss, calls = additive_loss(1.0, [0.1, 0.5])
    diags = [OK, ContributionDiagnostics(accepted=False, reason="norm 1e9 above max_delta_norm")]
    scores = score_round(["a", "b"], 1.0, [0.9, 0.5], diags, subset_loss,
                         ScoringConfig(marginal="leave_one_out"))
    assert scores[1].score == 0.0 and not scores[1].accepted
    assert scores[1].reason == "refused by validation: norm 1e9 above max_delta_norm"
    assert all(1 not in s for s in calls)
    assert scores[0].score == pytest.approx(0.1)


def test_zero_delta_gets_nothing_even_when_leaving_it_out_hurts():
    # Mean aggregation that overshoots: dilution by a zero delta *helps* the aggregate, so its
    # leave-one-out value is positive; the solo gain (0) still pays it nothing.
    def subset_loss(s):  # loss of base + mean over s of deltas (1 for "h", 0 for "zero")
        step = (0 in s) / len(s)
        return 1.0 + (step - 0.6) ** 2 - 0.36  # best step is 0.6
    scores = score_round(["h", "zero"], 1.0, [subset_loss(frozenset({0})), 1.0], [OK, OK],
                         subset_loss, ScoringConfig(marginal="leave_one_out"))
    assert scores[1].marginal > 0          # V({h, zero}) > V({h})
    assert scores[1].score == 0.0
    assert scores[0].score > 0


def test_budget_too_small_falls_back_to_the_solo_gain_and_says_so():
    subset_loss, calls = additive_loss(1.0, [0.1, 0.2, 0.3])
    res = score_round_detailed(list("abc"), 1.0, [0.9, 0.8, 0.7], [OK] * 3, subset_loss,
                               ScoringConfig(marginal="leave_one_out", max_evaluations=3))
    assert res.estimate.method == "solo" and "max_evaluations=3" in res.estimate.note
    assert calls == []
    assert [s.score for s in res.scores] == pytest.approx([0.1, 0.2, 0.3])
    res = score_round_detailed(list("abc"), 1.0, [0.9, 0.8, 0.7], [OK] * 3, None, ScoringConfig())
    assert res.estimate.method == "solo" and "no subset_loss" in res.estimate.note


def test_nothing_gained_means_zero_marginals():
    res = score_round_detailed(["a", "b"], 1.0, [0.9, 1.1], [OK, OK], lambda s: 1.0,
                               ScoringConfig())
    assert res.estimate.values == {0: 0.0, 1: 0.0} and res.estimate.evaluations == 1
    assert [s.score for s in res.scores] == [0.0, 0.0]


def zero_one_game(n: int, fixes: list[tuple[set[int], set[int]]]):
    """subset_loss of a 0-1 game on `n` scoring examples, the base answering the second half: each player answers
    the examples of its first set and breaks those of its second; a subset answers what the base or some member
    answers and no member breaks. Returns per-example losses, as exact-match scoring does."""
    def subset_loss(s: frozenset[int]) -> torch.Tensor:
        right = (set(range(n // 2, n)) | set().union(*(fixes[i][0] for i in s))) - set().union(*(fixes[i][1] for i in s))
        return torch.tensor([0.0 if q in right else 1.0 for q in range(n)])

    return subset_loss


@pytest.mark.parametrize("marginal", ["leave_one_out", "gtg_shapley"])
def test_a_gain_within_its_sampling_error_is_not_paid(marginal):
    """On 400 questions (the base answers 200) an honest delta answers 60 more and breaks none; a chance delta
    answers 21 and breaks 19: a net +2 that another draw of questions would as likely make -2. Both have a positive
    marginal; only the honest one is paid, and the chance one is told why. With the gate at 0 it is paid."""
    n = 400
    honest, chance = (set(range(60)), set()), (set(range(100, 121)), set(range(200, 219)))
    game = zero_one_game(n, [honest, chance])
    cfg = dict(marginal=marginal, truncation_tol=0.0, max_evaluations=100, max_permutations=8)
    solo = [0.5 - 60 / n, 0.5 - 2 / n]  # values are relative to the base's loss, 0.5
    res = score_round_detailed(["honest", "chance"], 0.5, solo, [OK, OK], game, ScoringConfig(**cfg),
                               base_losses=game(frozenset()))
    assert res.estimate.values == pytest.approx({0: 60 / n / 0.5, 1: 2 / n / 0.5})
    # the standard error of a mean of per-question gains: +1 on 60 questions (or 21), -1 on 19, 0 elsewhere
    expect = [torch.tensor([1.0] * 60 + [0.0] * (n - 60)).std() / n ** 0.5 / 0.5,
              torch.tensor([1.0] * 21 + [-1.0] * 19 + [0.0] * (n - 40)).std() / n ** 0.5 / 0.5]
    assert [res.estimate.errors[i] for i in (0, 1)] == pytest.approx([float(e) for e in expect])
    honest_score, chance_score = res.scores
    assert honest_score.score > 0 and honest_score.marginal_error == pytest.approx(float(expect[0]))
    assert chance_score.score == 0.0 and "x its standard error" in chance_score.reason
    ungated = score_round(["honest", "chance"], 0.5, solo, [OK, OK], game, ScoringConfig(**cfg, min_marginal_z=0.0),
                          base_losses=game(frozenset()))
    assert ungated[1].score > 0


def test_mean_losses_measure_no_error_and_gate_nothing():
    subset_loss, _ = additive_loss(1.0, [0.001, 0.2])
    res = score_round_detailed(["a", "b"], 1.0, [0.999, 0.8], [OK, OK], subset_loss,
                               ScoringConfig(marginal="leave_one_out", min_marginal_z=100.0))
    assert res.estimate.errors is None and math.isnan(res.scores[0].marginal_error)
    assert res.scores[0].score > 0  # nothing measured, nothing refused for it


def test_non_finite_solo_loss_counts_as_worse():
    scores = score_round(["a"], 1.0, [float("nan")], [OK], None, ScoringConfig())
    assert scores[0].score == 0.0 and scores[0].solo_gain == -math.inf


@pytest.mark.parametrize("kwargs, field", [
    (dict(marginal="exact"), "marginal"), (dict(max_evaluations=-1), "max_evaluations"),
    (dict(max_permutations=0), "max_permutations"), (dict(clip_exponent=-1.0), "clip_exponent"),
    (dict(unselected_factor=2.0), "unselected_factor"), (dict(min_marginal_z=-1.0), "min_marginal_z"),
])
def test_config_checks_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=f"`{field}`"):
        ScoringConfig(**kwargs)


def test_input_checks():
    with pytest.raises(ScoringInputError, match="same length"):
        score_round(["a", "b"], 1.0, [1.0], [OK, OK], None, ScoringConfig())
    with pytest.raises(ScoringInputError, match="duplicates"):
        score_round(["a", "a"], 1.0, [1.0, 1.0], [OK, OK], None, ScoringConfig())
    with pytest.raises(ScoringInputError, match="base_loss"):
        score_round(["a"], 0.0, [1.0], [OK], None, ScoringConfig())
    with pytest.raises(ScoringInputError, match="clip_factor"):
        ContributionDiagnostics(clip_factor=0.0)


game = st.integers(min_value=1, max_value=7).flatmap(lambda n: st.tuples(
    st.just(n), st.lists(st.floats(-0.5, 0.5), min_size=2 ** n, max_size=2 ** n)))


@settings(max_examples=60, deadline=None)
@given(g=game, budget=st.integers(0, 40), seed=st.integers(0, 2**31 - 1))
def test_gtg_budget_efficiency_and_scores_nonnegative(g, budget, seed):
    n, table = g
    calls: list[frozenset[int]] = []

    def subset_loss(s):  # any game: a random loss per coalition
        calls.append(s)
        return 1.0 + table[sum(1 << i for i in s)]

    v_full = -table[2 ** n - 1]
    cfg = ScoringConfig(max_evaluations=budget, truncation_tol=0.0, convergence_tol=0.0,
                        max_permutations=5)
    res = score_round_detailed([f"c{i}" for i in range(n)], 1.0, [1.0 + t for t in table[:n]],
                               [OK] * n, subset_loss, cfg,
                               generator=torch.Generator().manual_seed(seed))
    assert len(calls) == len(set(calls)) == res.estimate.evaluations <= budget
    assert frozenset() not in calls
    assert all(s.score >= 0 for s in res.scores)
    if res.estimate.method == "gtg_shapley" and abs(v_full) > cfg.between_tol:
        assert sum(res.estimate.values.values()) == pytest.approx(v_full, abs=1e-9)


def test_first_order_game_exact_numbers_and_bad_actors_unpaid():
    from zoo_gym.rewards import accept_by_quality, directional_slopes, linear_losses

    grad = {"w": torch.tensor([1.0, -2.0]), "b": torch.tensor([0.5])}
    deltas = [{"w": torch.tensor([-0.1, 0.1]), "b": torch.tensor([0.0])},    # slope -0.3
              {"w": torch.tensor([-0.2, 0.0]), "b": torch.tensor([-0.2])},   # slope -0.3
              {"w": torch.zeros(2), "b": torch.zeros(1)},                    # 0
              {"w": torch.tensor([0.1, -0.1]), "b": torch.tensor([0.0])}]    # +0.3 (sign-flip)
    slopes = directional_slopes(grad, deltas)
    assert slopes == pytest.approx([-0.3, -0.3, 0.0, 0.3])
    solo, subset_loss = linear_losses(base_loss=3.0, slopes=slopes, weights=[1, 1, 1, 1])
    assert subset_loss(frozenset({0, 3})) == pytest.approx(3.0)
    assert subset_loss(frozenset({0, 1, 2})) == pytest.approx(2.8)
    scores = score_round(list("abcd"), 3.0, solo, [OK] * 4, subset_loss,
                         ScoringConfig(marginal="leave_one_out"))
    # g = 0.1 for a and b; V(N) = (0.6 - 0.3) / 4 / 3 = 0.025, V(N\a) = 0, V(N\c) = 0.1 / 3,
    # V(N\d) = 0.2 / 3 -> m = 0.025, 0.025, -1/120, -1/24; scores sqrt(0.1 x 0.025) = 0.05.
    assert [s.marginal for s in scores] == pytest.approx([0.025, 0.025, -1 / 120, -1 / 24])
    assert [s.score for s in scores] == pytest.approx([0.05, 0.05, 0.0, 0.0])
    assert accept_by_quality(scores) == [True, True, False, False]
