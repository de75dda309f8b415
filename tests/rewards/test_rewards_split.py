"""split_pool: exact integer split by largest remainder."""

from __future__ import annotations

from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zoo_gym.rewards import SplitError, split_pool


def test_hand_computed_split():
    # quotas 100 * (1, 1, 1) / 3 = 33.33 each: floors 33+33+33 = 99, one unit left; equal
    # remainders go to the smallest id.
    assert split_pool(100, ["c", "a", "b"], [1.0, 1.0, 1.0]) == {"c": 33, "a": 34, "b": 33}


def test_largest_remainder_wins():
    # quotas 10 * (0.55, 0.3, 0.15) = 5.5, 3.0, 1.5: floors 5, 3, 1 -> 1 left; remainders
    # 0.5, 0.0, 0.5 -> tie between a and c, "a" < "c".
    assert split_pool(10, ["a", "b", "c"], [0.55, 0.3, 0.15]) == {"a": 6, "b": 3, "c": 1}


def test_zero_weights_get_nothing_and_all_zero_pays_nobody():
    assert split_pool(7, ["a", "b", "c"], [0.0, 2.0, 0.0]) == {"a": 0, "b": 7, "c": 0}
    assert split_pool(7, ["a", "b"], [0.0, 0.0]) == {"a": 0, "b": 0}


def test_float_drift_free_for_tiny_and_huge_weights():
    # Exact binary fractions, so the true quotas are 1/5, 1/5, 3/5 of 10**18 (a float ratio
    # computation would be off in the last digits at this pool size).
    w = [2.0**-1000, 2.0**-1000, 3 * 2.0**-1000]
    assert split_pool(10**18, ["x", "y", "z"], w) == {"x": 2 * 10**17, "y": 2 * 10**17,
                                                      "z": 6 * 10**17}


@pytest.mark.parametrize("pool, weights, match", [
    (-1, [1.0], "pool"), (1.5, [1.0], "pool"), (True, [1.0], "pool"),
    (10, [float("nan")], "finite"), (10, [-1.0], "finite"), (10, [float("inf")], "finite"),
])
def test_bad_inputs_are_refused(pool, weights, match):
    with pytest.raises(SplitError, match=match):
        split_pool(pool, ["a"][: len(weights)], weights)


def test_duplicates_and_length_mismatch_refused():
    with pytest.raises(SplitError, match="duplicates"):
        split_pool(5, ["a", "a"], [1.0, 1.0])
    with pytest.raises(SplitError, match="same length"):
        split_pool(5, ["a", "b"], [1.0])


weights_st = st.lists(st.floats(min_value=0.0, max_value=1e6, allow_nan=False), min_size=1,
                      max_size=12)


@settings(max_examples=150, deadline=None)
@given(pool=st.integers(min_value=0, max_value=10**12), weights=weights_st)
def test_sums_exactly_and_stays_within_one_of_quota(pool, weights):
    ids = [f"c{i:02d}" for i in range(len(weights))]
    shares = split_pool(pool, ids, weights)
    total = sum(Fraction(w) for w in weights)
    if total == 0:
        assert sum(shares.values()) == 0
        return
    assert sum(shares.values()) == pool
    for who, w in zip(ids, weights):
        quota = pool * Fraction(w) / total
        assert quota - 1 < shares[who] <= quota + 1 or (w == 0 and shares[who] == 0)
        if w == 0:
            assert shares[who] == 0


@settings(max_examples=100, deadline=None)
@given(pool=st.integers(min_value=0, max_value=10**6), weights=weights_st, data=st.data())
def test_order_of_contributors_does_not_matter(pool, weights, data):
    ids = [f"c{i:02d}" for i in range(len(weights))]
    perm = data.draw(st.permutations(list(range(len(ids)))))
    a = split_pool(pool, ids, weights)
    b = split_pool(pool, [ids[i] for i in perm], [weights[i] for i in perm])
    assert a == b


@settings(max_examples=100, deadline=None)
@given(pool=st.integers(min_value=0, max_value=10**6), weights=weights_st)
def test_more_weight_never_gets_less(pool, weights):
    ids = [f"c{i:02d}" for i in range(len(weights))]
    shares = split_pool(pool, ids, weights)
    for i in range(len(ids)):
        for j in range(len(ids)):
            if weights[i] > weights[j]:
                assert shares[ids[i]] >= shares[ids[j]]
