"""Reputation EMA, aggregation weights, acceptance threshold and the stored book."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sqlalchemy.pool import StaticPool
from sqlmodel import Session, create_engine

from zoo_gym.rewards import (ConfigError, ContributionScore, ReputationBook, ReputationConfig,
                             accept_by_quality, aggregation_weights, create_ledger_tables,
                             next_reputation, quality_threshold)

CFG = ReputationConfig()  # initial 0.1, alpha 0.2, penalty 0.5


def test_newcomer_earns_trust_over_rounds_exactly():
    r, seen = None, []
    for _ in range(3):
        r = next_reputation(r, target=1.0, config=CFG)
        seen.append(r)
    # 1 - 0.9 * 0.8**k
    assert seen == pytest.approx([0.28, 0.424, 0.5392])


def test_refusal_costs_more_than_a_good_round_earns():
    assert next_reputation(0.5, target=None, config=CFG) == pytest.approx(0.25)
    assert next_reputation(None, target=None, config=CFG) == pytest.approx(0.05)
    up = next_reputation(0.5, target=1.0, config=CFG) - 0.5
    down = 0.5 - next_reputation(0.5, target=None, config=CFG)
    assert down > up > 0


@settings(max_examples=100, deadline=None)
@given(r=st.floats(0, 1), t=st.one_of(st.none(), st.floats(-5, 5)))
def test_reputation_stays_in_unit_interval(r, t):
    assert 0.0 <= next_reputation(r, target=t, config=CFG) <= 1.0


def test_aggregation_weights_clamp_and_normalise():
    w = aggregation_weights(["a", "b", "c", "new"], {"a": 0.9, "b": 0.01, "c": 1.0},
                            floor=0.05, cap=0.6, initial=0.1)
    # clamped 0.6, 0.05, 0.6, 0.1 -> sum 1.35
    assert w.tolist() == pytest.approx([0.6 / 1.35, 0.05 / 1.35, 0.6 / 1.35, 0.1 / 1.35])
    assert w.dtype == torch.float64 and float(w.sum()) == pytest.approx(1.0)
    with pytest.raises(ConfigError, match="`floor`"):
        aggregation_weights(["a"], {}, floor=0.0, cap=1.0)


@settings(max_examples=50, deadline=None)
@given(reps=st.lists(st.floats(0, 1), min_size=1, max_size=20))
def test_weights_bounded_ratio(reps):
    ids = [f"c{i}" for i in range(len(reps))]
    w = aggregation_weights(ids, dict(zip(ids, reps)), floor=0.05, cap=1.0)
    assert float(w.sum()) == pytest.approx(1.0)
    assert float(w.max() / w.min()) <= 1.0 / 0.05 + 1e-9


@pytest.mark.parametrize("kwargs, field", [
    (dict(initial=1.5), "initial"), (dict(alpha=0.0), "alpha"),
    (dict(penalty_alpha=2.0), "penalty_alpha"), (dict(floor=0.0), "floor"),
    (dict(floor=0.5, cap=0.4), "floor"),
])
def test_config_checks_name_the_field(kwargs, field):
    with pytest.raises(ConfigError, match=f"`{field}`"):
        ReputationConfig(**kwargs)


def _score(who: str, s: float, accepted: bool = True) -> ContributionScore:
    return ContributionScore(contributor=who, score=s, accepted=accepted, reason="", solo_gain=s,
                             marginal=s, value=s, participation=1.0, consensus=1.0,
                             method="leave_one_out")


def test_acceptance_is_80_percent_of_the_validated_median():
    scores = [_score("a", 1.0), _score("b", 0.85), _score("c", 0.79), _score("d", 0.0),
              _score("e", 0.0, accepted=False)]
    # validated median of (1.0, 0.85, 0.79, 0.0) = 0.82 -> threshold 0.656: c passes.
    assert quality_threshold(scores, min_quality=0.8) == pytest.approx(0.656)
    assert accept_by_quality(scores) == [True, True, True, False, False]
    scores = [_score("a", 1.0), _score("b", 0.85), _score("c", 0.5)]
    assert accept_by_quality(scores) == [True, True, False]  # 0.5 < 0.8 x 0.85


def test_median_zero_pays_only_who_helped_and_all_zero_pays_nobody():
    scores = [_score("h", 0.2), _score("f1", 0.0), _score("f2", 0.0)]
    assert accept_by_quality(scores) == [True, False, False]
    assert accept_by_quality([_score("f1", 0.0), _score("f2", 0.0)]) == [False, False]


def test_book_stores_and_reads_back():
    engine = create_engine("sqlite://", connect_args={"check_same_thread": False},
                           poolclass=StaticPool)
    create_ledger_tables(engine)
    book = ReputationBook(lambda: Session(engine))
    assert book.values(["a", "b"]) == {"a": 0.1, "b": 0.1}
    book.record({"a": 0.28}, round_id=0)
    book.record({"a": 0.424, "b": 0.05}, round_id=1)
    assert book.values(["a", "b", "c"]) == {"a": 0.424, "b": 0.05, "c": 0.1}
    row = book.get("a")
    assert (row.value, row.rounds, row.updated_round) == (0.424, 2, 1)
    assert book.get("zz").rounds == 0
    with pytest.raises(ConfigError, match="reputation of 'a'"):
        book.record({"a": 1.5}, round_id=2)
    engine.dispose()
