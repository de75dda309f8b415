"""First-order scoring: the linear Shapley game, slopes (streamed and tapped), the base gradient on
the tiny model, and the guarantees of score_round_first_order (honest paid strictly more; zero,
random and sign-flip deltas earn 0; pools conserved; the exact check catches an overshoot)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zoo_gym.aggregation import DeltaSoup, SoupConfig
from zoo_gym.aggregation.sources import DictDeltaSource
from zoo_gym.rewards import (ConfigError, ContributionDiagnostics, FirstOrderConfig,
                             ScoringConfig, ScoringInputError, SettlementConfig, SlopeTap,
                             accept_by_quality, directional_slopes, linear_shapley,
                             plan_settlement, score_round_first_order, streamed_slopes)


def _brute_shapley(a, w):
    """Slow reference: average marginals over all n! orders of V(S) = sum w a / sum w."""
    n = len(a)

    def v(s):
        tw = sum(w[i] for i in s)
        return sum(w[i] * a[i] for i in s) / tw if tw > 0 else 0.0

    phi = [0.0] * n
    perms = list(itertools.permutations(range(n)))
    for order in perms:
        prefix = []
        for p in order:
            before = v(prefix)
            prefix.append(p)
            phi[p] += v(prefix) - before
    return [x / len(perms) for x in phi]


def test_linear_shapley_two_players_hand_computed():
    # V({0}) = 0.1, V({1}) = 0.2, V(N) = (0.1*1 + 0.2*3) / 4 = 0.175
    # phi_0 = (0.1 + (0.175 - 0.2)) / 2 = 0.0375; phi_1 = (0.2 + (0.175 - 0.1)) / 2 = 0.1375
    phi, used, exact = linear_shapley([0.1, 0.2], [1.0, 3.0], permutations=16,
                                      generator=torch.Generator().manual_seed(0))
    assert exact and used == 2
    assert phi == pytest.approx([0.0375, 0.1375], abs=1e-15)


def test_linear_shapley_exact_matches_brute_force_and_zero_weight_gets_zero():
    a, w = [0.3, -0.1, 0.05, 0.2, 0.0], [1.0, 2.0, 0.5, 0.0, 1.5]
    phi, used, exact = linear_shapley(a, w, permutations=120,
                                      generator=torch.Generator().manual_seed(0))
    assert exact and used == 120
    assert phi == pytest.approx(_brute_shapley(a, w), abs=1e-12)
    assert phi[3] == 0.0  # weight 0: never changes the aggregate


def test_linear_shapley_sampled_close_to_closed_form_for_equal_weights():
    # equal weights: phi_i = (a_i + (a_i - mean_{j != i} a_j) (H_n - 1)) / n
    n = 12
    a = [0.01 * (i - 3) for i in range(n)]
    h = sum(1.0 / k for k in range(1, n + 1))
    want = [(a[i] + (a[i] - (sum(a) - a[i]) / (n - 1)) * (h - 1)) / n for i in range(n)]
    phi, used, exact = linear_shapley(a, [1.0] * n, permutations=20000,
                                      generator=torch.Generator().manual_seed(1))
    assert not exact and used == 20000
    assert phi == pytest.approx(want, abs=4e-4)
    assert sum(phi) == pytest.approx(sum(a) / n, abs=1e-12)  # efficiency


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.floats(-1, 1), st.floats(0, 5)), min_size=1, max_size=9),
       st.integers(1, 300))
def test_linear_shapley_is_efficient(pairs, permutations):
    a, w = [p[0] for p in pairs], [p[1] for p in pairs]
    phi, _, _ = linear_shapley(a, w, permutations=permutations,
                               generator=torch.Generator().manual_seed(2))
    tw = sum(w)
    v_full = sum(x * y for x, y in zip(a, w)) / tw if tw > 0 else 0.0
    assert sum(phi) == pytest.approx(v_full, abs=1e-9)


def test_linear_shapley_refuses_bad_input():
    with pytest.raises(ScoringInputError, match="same length"):
        linear_shapley([0.1], [1.0, 1.0], permutations=4, generator=torch.Generator())
    with pytest.raises(ScoringInputError, match=">= 0"):
        linear_shapley([0.1], [-1.0], permutations=4, generator=torch.Generator())


def _world(n_honest: int, d: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    grad = {"w": torch.randn(8, d // 8, generator=gen), "b": torch.randn(d % 8 or 3, generator=gen)}
    gflat = torch.cat([v.reshape(-1) for v in grad.values()])
    honest = []
    for _ in range(n_honest):
        step = -gflat / gflat.norm() * 0.05 + torch.randn(gflat.shape, generator=gen) * 0.05 / gflat.numel() ** 0.5
        honest.append(step)
    rand = torch.randn(gflat.shape, generator=gen)
    rand = rand / rand.norm() * 0.05
    rows = honest + [torch.zeros_like(gflat), rand, -honest[0]]

    def unflat(x):
        out, o = {}, 0
        for k, v in grad.items():
            out[k] = x[o:o + v.numel()].reshape(v.shape)
            o += v.numel()
        return out

    return grad, [unflat(r) for r in rows]


def test_streamed_and_tapped_slopes_equal_the_slow_reference():
    grad, deltas = _world(5, 400, 0)
    ids = [f"c{i}" for i in range(len(deltas))]
    scales = [1.0, 0.5, 1.0, 0.25, 1.0, 1.0, 1.0, 0.9]
    want = directional_slopes(grad, [{k: v * c for k, v in d.items()} for d, c in zip(deltas, scales)])
    slopes, norms = streamed_slopes(grad, DictDeltaSource(ids, deltas), scales=scales)
    assert slopes == pytest.approx(want, rel=1e-6, abs=1e-9)
    assert norms[5] == 0.0 and norms[0] == pytest.approx(
        math.sqrt(sum(float((v.double() ** 2).sum()) for v in deltas[0].values())), rel=1e-6)
    tap = SlopeTap(DictDeltaSource(ids, deltas), grad)
    with pytest.raises(ScoringInputError, match="after DeltaSoup.run"):
        tap.result(scales=scales)
    DeltaSoup(SoupConfig(aggregator="mean")).run(tap, lambda name, t: None)
    t_slopes, t_norms = tap.result(scales=scales)
    assert t_slopes == pytest.approx(slopes, rel=1e-12, abs=1e-15)
    assert t_norms == pytest.approx(norms, rel=1e-12)
    assert tap.contributors == ids  # passed through
    with pytest.raises(ScoringInputError, match="lacks"):
        streamed_slopes({"w": grad["w"]}, DictDeltaSource(ids, deltas), scales=scales)


def _score(grad, deltas, *, exact=None, fo=FirstOrderConfig()):
    n = len(deltas)
    ids = [f"c{i}" for i in range(n)]
    slopes, norms = streamed_slopes(grad, DictDeltaSource(ids, deltas), scales=[1.0] * n)
    g_norm = math.sqrt(sum(float((v.double() ** 2).sum()) for v in grad.values()))
    numel = sum(v.numel() for v in grad.values())
    return score_round_first_order(
        ids, base_loss=2.0, grad_norm=g_norm, numel=numel, slopes=slopes, norms=norms,
        weights=[1.0] * n, diagnostics=[ContributionDiagnostics()] * n, config=ScoringConfig(),
        first_order=fo, exact_solo_loss=exact)


@settings(max_examples=15, deadline=None, derandomize=True)
@given(st.integers(0, 10_000), st.integers(3, 9))
def test_honest_paid_strictly_more_bad_ones_earn_zero_pool_conserved(seed, n_honest):
    grad, deltas = _world(n_honest, 4000, seed)
    res = _score(grad, deltas)
    s = [x.score for x in res.scores]
    zero, rand, flip = s[n_honest], s[n_honest + 1], s[n_honest + 2]
    assert zero == 0.0 and rand == 0.0 and flip == 0.0
    assert min(s[:n_honest]) > 0.0
    reason = res.scores[n_honest + 1].reason  # its slope's sign is a coin flip: either check
    assert "random direction" in reason or "did not improve" in reason
    ok = accept_by_quality(res.scores)
    assert not any(ok[n_honest:])
    plan = plan_settlement(round_id=1, scores=res.scores, reputations={}, pool=1000,
                           config=SettlementConfig())
    assert plan.paid_total == 1000
    paid = {p.contributor: p.amount for p in plan.payouts}
    assert all(paid[f"c{i}"] == 0 for i in range(n_honest, n_honest + 3))
    assert min(paid[f"c{i}"] for i in range(n_honest) if ok[i]) > 0


def test_exact_check_zeroes_an_overshoot_and_runs_only_top_k():
    grad, deltas = _world(4, 800, 3)
    calls = []
    promised = {}

    def exact(i):
        calls.append(i)
        # contributor 0 overshoots: the loss rises by 3x what first order promised it would fall
        return 2.0 + (3.0 * promised[0] * 2.0 if i == 0 else -0.5 * promised[i] * 2.0)

    first = _score(grad, deltas)
    for i, sc in enumerate(first.scores):
        promised[i] = sc.solo_gain
    top = sorted(range(7), key=lambda i: (-first.scores[i].score, f"c{i}"))[:2]
    deltas[0], deltas[top[0]] = deltas[top[0]], deltas[0]  # put the overshooter on top
    first = _score(grad, deltas)
    promised = {i: sc.solo_gain for i, sc in enumerate(first.scores)}
    res = _score(grad, deltas, exact=exact, fo=FirstOrderConfig(verify_top_k=2))
    assert len(calls) == 2 and 0 in calls and res.estimate.evaluations == 2
    assert res.scores[0].score == 0.0 and "exact check failed" in res.scores[0].reason
    assert all(res.scores[i].score > 0 for i in calls if i != 0)  # within the slack: kept
    assert first.scores[0].score > 0  # without the check the overshooter would be paid


def test_first_order_config_names_the_field():
    with pytest.raises(ConfigError, match="`permutations`"):
        FirstOrderConfig(permutations=0)
    with pytest.raises(ConfigError, match="`min_cosine_z`"):
        FirstOrderConfig(min_cosine_z=-1.0)
    with pytest.raises(ConfigError, match="`verify_top_k`"):
        FirstOrderConfig(verify_top_k=-1)
    with pytest.raises(ConfigError, match="`verify_slack`"):
        FirstOrderConfig(verify_slack=math.nan)


def test_base_gradient_matches_the_evaluator_and_a_finite_difference():
    from zoo_gym.gym_train import Evaluator, default_validation_examples, tiny_model_dir
    from zoo_gym.rewards import base_gradient

    torch.manual_seed(0)
    ev = Evaluator(tiny_model_dir(), default_validation_examples(n=4))
    g = base_gradient(ev.model, ev._batches)  # noqa: SLF001 (the evaluator's own batches)
    assert g.base_loss == pytest.approx(ev.loss(None), rel=1e-5)
    assert g.examples == 4 and g.tokens > 0
    assert all(p.grad is None for p in ev.model.parameters())  # left as found
    name = "model.layers.0.mlp.down_proj.weight"
    d = {name: torch.randn(g.grad[name].shape, generator=torch.Generator().manual_seed(1)) * 1e-3}
    fd = (ev.loss(d, scale=1.0) - ev.loss(d, scale=-1.0)) / 2.0  # central difference
    slope = directional_slopes(g.grad, [d])[0]
    assert slope != 0.0
    assert fd == pytest.approx(slope, rel=0.05)
