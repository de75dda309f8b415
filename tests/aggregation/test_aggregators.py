"""Aggregators on hand-computed tensors, refusals of non-robust configurations, and properties."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from zoo_gym.aggregation import (NotRobustConfigError, bulyan, centered_clip, geometric_median,
                                 krum, mean, median, multi_krum, pairwise_sq_distances,
                                 trimmed_mean)
from zoo_gym.aggregation.bulyan import bulyan_select
from zoo_gym.aggregation.errors import InvalidDeltaError
from zoo_gym.aggregation.krum import krum_scores
from zoo_gym.aggregation.weights import cap_weights

X5 = torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, 30.0], [4.0, 40.0], [100.0, -100.0]])


def test_mean_weighted_and_uniform():
    assert mean(X5).aggregate.tolist() == pytest.approx([22.0, 0.0])
    r = mean(X5[:2], weights=torch.tensor([3.0, 1.0]))
    assert r.aggregate.tolist() == pytest.approx([1.25, 12.5])
    assert r.diagnostics.weight_used.tolist() == [0.75, 0.25]


def test_means_are_the_float64_sum_divided_once_on_any_cpu():
    # Contract: accumulate in float64, divide once, round once to float32. On these inputs the
    # float64 sums are exact (randn float32 values, integer weights), so the result is the same
    # bit for bit on every CPU, BLAS and thread count; a float32 matmul with weights 1/n is not.
    g = torch.Generator().manual_seed(0)
    x = torch.randn(7, 10_000, generator=g)
    x64 = x.double()
    assert torch.equal(mean(x).aggregate, (x64.sum(0) / 7).float())
    w = torch.tensor([3.0, 1.0, 2.0, 5.0, 1.0, 1.0, 2.0])
    assert torch.equal(mean(x, weights=w).aggregate,
                       ((w.double()[:, None] * x64).sum(0) / 15).float())
    kept = x64.sort(dim=0).values[1:6]  # beta=0.2 trims 1 from each end of 7
    assert torch.equal(trimmed_mean(x, beta=0.2).aggregate, (kept.sum(0) / 5).float())
    assert mean(X5).aggregate.tolist() == [22.0, 0.0]  # exactly, not approximately
    huge = torch.tensor([[3e38], [3e38], [-1.0]])  # float32 partial sums would overflow to inf
    assert mean(huge).aggregate.tolist() == [pytest.approx(2e38, rel=1e-7)]
    assert median(huge[:2]).aggregate.tolist() == [pytest.approx(3e38, rel=1e-7)]


def test_median_odd_even_and_trimmed_share():
    assert median(X5).aggregate.tolist() == [3.0, 20.0]
    r = median(X5[:4])
    assert r.aggregate.tolist() == [2.5, 25.0]  # average of the two middle values
    assert r.diagnostics.trimmed_share.tolist() == [1.0, 0.0, 0.0, 1.0]


def test_trimmed_mean_still_trims_at_small_n():
    x = torch.tensor([[0.0], [1.0], [2.0], [1000.0]])
    r = trimmed_mean(x, beta=0.2)  # Flower: floor(0.2 * 4) = 0, no trimming, mean 250.75
    assert r.aggregate.tolist() == [1.5]
    assert r.diagnostics.trimmed_share.tolist() == [1.0, 0.0, 0.0, 1.0]
    assert trimmed_mean(x, beta=0.0).aggregate.tolist() == [250.75]
    with pytest.raises(NotRobustConfigError, match="at least 3 contributors"):
        trimmed_mean(x[:2], beta=0.2)


def test_trimmed_mean_weighted():
    x = torch.tensor([[0.0], [1.0], [3.0], [1000.0], [-5.0]])
    r = trimmed_mean(x, beta=0.2, weights=torch.tensor([1.0, 1.0, 2.0, 1.0, 1.0]))
    assert r.aggregate.tolist() == pytest.approx([(0 + 1 + 2 * 3) / 4])


def test_krum_scores_exclude_self_and_pick_the_honest_cluster():
    d = pairwise_sq_distances(X5)
    # n=5, f=1 -> 2 nearest others per contributor
    s = krum_scores(d, f=1)
    assert s[0].item() == pytest.approx(101.0 + 404.0)
    assert s[1].item() == pytest.approx(101.0 + 101.0)
    r = krum(X5, f=1)
    assert r.aggregate.tolist() == [2.0, 20.0]
    assert r.diagnostics.selected.tolist() == [False, True, False, False, False]
    mk = multi_krum(X5, f=1)  # m = n - f = 4: the attacker is out
    assert mk.aggregate.tolist() == pytest.approx([2.5, 25.0])
    assert not bool(mk.diagnostics.selected[4])


def test_krum_refuses_n_at_most_2f_plus_2():
    with pytest.raises(NotRobustConfigError, match="n >= 2f \\+ 3 = 7"):
        krum(torch.randn(6, 3), f=2)
    krum(torch.randn(7, 3), f=2)


def test_bulyan_refuses_n_below_4f_plus_3_and_aggregates():
    with pytest.raises(NotRobustConfigError, match="4f \\+ 3 = 7"):
        bulyan(torch.randn(6, 3), f=1)
    x = torch.cat([torch.arange(6.0)[:, None].repeat(1, 2), torch.tensor([[1e3, -1e3]])])
    chosen = bulyan_select(pairwise_sq_distances(x), f=1)
    assert 6 not in chosen.tolist() and chosen.numel() == 5
    r = bulyan(x, f=1)
    assert bool(torch.all((r.aggregate >= 0) & (r.aggregate <= 5)))
    assert r.diagnostics.trimmed_share[6].item() == 1.0


def test_inflated_weight_does_not_buy_influence_in_multi_krum():
    w = torch.tensor([1.0, 1.0, 1.0, 1.0, 1e9])  # attacker claims a billion samples
    r = multi_krum(X5, f=1, weights=w)
    assert r.aggregate.tolist() == pytest.approx([2.5, 25.0])
    capped = cap_weights(torch.tensor([1.0, 1.0, 1.0, 1e9]), n=4, max_share=0.4)
    assert capped.max().item() == pytest.approx(0.4) and capped.sum().item() == pytest.approx(1.0)


def test_geometric_median_matches_direct_weiszfeld():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 5, generator=g, dtype=torch.float64)
    v = x.mean(0)
    for _ in range(200):  # slow, obvious reference
        b = 1.0 / (x - v).norm(dim=1).clamp(min=1e-6)
        v = (b[:, None] * x).sum(0) / b.sum()
    got = geometric_median(x, eps=0.0, max_iter=200).aggregate
    assert torch.allclose(got, v, atol=1e-7)
    x_bad = torch.cat([x, torch.full((2, 5), 1e6, dtype=torch.float64)])
    assert geometric_median(x_bad).aggregate.abs().max() < 10


def test_centered_clip_matches_direct_iteration_and_handles_zero_distance():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(6, 4, generator=g, dtype=torch.float64)
    v = torch.zeros(4, dtype=torch.float64)
    for _ in range(3):
        diff = x - v
        r = diff.norm(dim=1)
        f = torch.clamp(0.5 / r, max=1.0)
        v = v + (diff * f[:, None]).mean(0)
    got = centered_clip(x, tau=0.5, iters=3)
    assert torch.allclose(got.aggregate, v, atol=1e-10)
    zero = centered_clip(torch.zeros(3, 4), tau=1.0)
    assert zero.aggregate.tolist() == [0.0] * 4


def test_inputs_not_mutated_and_nonfinite_refused():
    x = X5.clone()
    for fn in (lambda t: bulyan(torch.cat([t, t + 0.5]), f=1), lambda t: multi_krum(t, f=1),
               median, lambda t: trimmed_mean(t, beta=0.2), geometric_median,
               lambda t: centered_clip(t, tau=1.0)):
        fn(x)
        assert torch.equal(x, X5)
    with pytest.raises(InvalidDeltaError, match="rows \\[1\\]"):
        mean(torch.tensor([[1.0], [math.nan]]))


_stack = st.integers(5, 9).flatmap(lambda n: st.lists(
    st.lists(st.floats(-100, 100, width=32), min_size=3, max_size=3), min_size=n, max_size=n))


@settings(max_examples=40, deadline=None)
@given(rows=_stack, perm_seed=st.integers(0, 1000))
def test_robust_aggregates_are_within_coordinate_range_and_order_free(rows, perm_seed):
    x = torch.tensor(rows, dtype=torch.float32)
    n = x.shape[0]
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(perm_seed))
    lo, hi = x.min(0).values - 1e-3, x.max(0).values + 1e-3
    for fn in (median, lambda t: trimmed_mean(t, beta=0.2)):
        a, b = fn(x).aggregate, fn(x[perm]).aggregate
        assert bool(((a >= lo) & (a <= hi)).all())
        assert torch.allclose(a, b, atol=1e-4)
    # selection rules break score ties by index, so only the range property is order-free
    a = bulyan(x, f=(n - 3) // 4).aggregate
    assert bool(((a >= lo) & (a <= hi)).all())
    assert bool(((multi_krum(x, f=1).aggregate >= lo) & (multi_krum(x, f=1).aggregate <= hi)).all())
