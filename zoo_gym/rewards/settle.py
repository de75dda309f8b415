"""Settling a round: scores + reputations + pool -> payouts, reputation updates, ledger entries.

Paid submissions (``acceptance.py``) weigh score x reputation before the round; the pool is split by
``split_pool`` (integers, sum = pool); reputations move by ``reputation.py``. Every submission gets one
ledger entry: kind "reward" (amount >= 0) when paid, "refusal" (amount 0, with the reason) otherwise,
carrying its score and reputation after the round. `settle_round` writes entries and reputations in one
transaction and refuses to settle a round twice. Formulas: docs/design/rewards-settlement.md.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .acceptance import accept_by_quality, quality_threshold
from .errors import ConfigError, RoundAlreadySettledError, ScoringInputError
from .ledger import Ledger, LedgerEntryPublic, NewEntry
from .reputation import ReputationBook, ReputationConfig, next_reputation
from .scoring import ContributionScore
from .split import split_pool


@dataclass(frozen=True)
class SettlementConfig:
    """Payout policy of a round."""

    min_quality: float = field(default=0.8, metadata={
        "help": "paid only with a score >= this x the round's median validated score"})
    reputation: ReputationConfig = field(default_factory=ReputationConfig, metadata={"prefix": "reputation_"})

    def __post_init__(self) -> None:
        if not (math.isfinite(self.min_quality) and 0.0 <= self.min_quality):
            raise ConfigError(f"`min_quality` must be finite and >= 0, got {self.min_quality}")


@dataclass(frozen=True)
class Payout:
    """One submission's outcome."""

    contributor: str
    paid: bool
    amount: int
    score: float
    reputation_before: float
    reputation_after: float
    reason: str


@dataclass(frozen=True)
class SettlementPlan:
    round_id: int
    pool: int
    payouts: list[Payout]

    @property
    def paid_total(self) -> int:
        return sum(p.amount for p in self.payouts)

    def entries(self) -> list[NewEntry]:
        return [NewEntry(round_id=self.round_id, contributor=p.contributor,
                         kind="reward" if p.paid else "refusal", amount=p.amount, score=p.score,
                         reputation_after=p.reputation_after, reason=p.reason)
                for p in self.payouts]

    def reputations(self) -> dict[str, float]:
        return {p.contributor: p.reputation_after for p in self.payouts}


@dataclass(frozen=True)
class Settlement:
    plan: SettlementPlan
    entries: list[LedgerEntryPublic]


def plan_settlement(*, round_id: int, scores: Sequence[ContributionScore],
                    reputations: Mapping[str, float], pool: int,
                    config: SettlementConfig) -> SettlementPlan:
    """Pure: who is paid how much and the reputations after the round."""
    who = [s.contributor for s in scores]
    if len(set(who)) != len(who):
        raise ScoringInputError("a contributor appears twice among the scores of one round")
    rc = config.reputation
    paid = accept_by_quality(scores, min_quality=config.min_quality)
    threshold = quality_threshold(scores, min_quality=config.min_quality)
    valid = [s.score for s in scores if s.accepted]
    median = statistics.median(valid) if valid else 0.0
    before = {w: float(reputations.get(w, rc.initial)) for w in who}
    weights = [s.score * before[s.contributor] if ok else 0.0 for s, ok in zip(scores, paid)]
    amounts = split_pool(pool, who, weights)
    payouts = []
    for s, ok in zip(scores, paid):
        r0 = before[s.contributor]
        if s.accepted and s.score > 0:
            target = 1.0 if median <= 0 else min(1.0, s.score / median)
            r1 = next_reputation(r0, target=target, config=rc)
        else:
            r1 = next_reputation(r0, target=None, config=rc)
        if ok:
            reason = (f"paid {amounts[s.contributor]} of {pool}: score {s.score:.4g} x "
                      f"reputation {r0:.3g}; {s.reason}")
        elif s.accepted and s.score > 0:
            reason = (f"below minimum quality: score {s.score:.4g} < {config.min_quality} x "
                      f"median {median:.4g} = {threshold:.4g}")
        else:
            reason = s.reason
        payouts.append(Payout(contributor=s.contributor, paid=ok, amount=amounts[s.contributor],
                              score=s.score, reputation_before=r0, reputation_after=r1,
                              reason=reason))
    return SettlementPlan(round_id=round_id, pool=pool, payouts=payouts)


def settle_round(*, round_id: int, scores: Sequence[ContributionScore], pool: int,
                 ledger: Ledger, book: ReputationBook,
                 config: SettlementConfig | None = None) -> Settlement:
    """Plan the round and write its ledger entries and reputations in one transaction.

    Raises `RoundAlreadySettledError` if the ledger already holds entries of ``round_id``.
    """
    config = config or SettlementConfig(reputation=book.config)
    with ledger.session_factory() as session:
        if ledger.has_round(round_id, session=session):
            raise RoundAlreadySettledError(f"round {round_id} is already in the ledger; it was "
                                           "settled before and will not be paid twice")
        reps = book.values([s.contributor for s in scores], session=session)
        plan = plan_settlement(round_id=round_id, scores=scores, reputations=reps, pool=pool,
                               config=config)
        stored = ledger.append(plan.entries(), session=session)
        book.record(plan.reputations(), round_id=round_id, session=session)
        session.commit()
    return Settlement(plan=plan, entries=stored)
