"""Several rounds end to end: honest contributors, a zero-delta and a random-delta free-rider and
a sign-flip attacker, scored, settled into the ledger, with the real aggregators.

The world is a quadratic loss L(theta) = 1 + mean((theta - theta*)^2) over d parameters; honest
contributors step towards theta* from their own noisy data, the server's validation loss is L.
"""

from __future__ import annotations

import pytest
import torch
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import text
from sqlalchemy.pool import StaticPool
from sqlmodel import Session, create_engine

from zoo_gym.aggregation import clip_factors, mean, multi_krum
from zoo_gym.rewards import (ContributionDiagnostics, Ledger, ReputationBook, ScoringConfig,
                             aggregation_weights, create_ledger_tables, score_round,
                             settle_round, verify_chain, verify_entries)

D = 256
HONEST = ["h0", "h1", "h2", "h3", "h4"]
BAD = ["free", "rand", "flip"]
POOL = 1000


def _loss(theta: torch.Tensor, target: torch.Tensor) -> float:
    return 1.0 + float(((theta - target) ** 2).mean())


def _deltas(theta, target, gen) -> torch.Tensor:
    """(8, D): 5 honest steps, a zero delta, a random delta of honest size, a sign-flip."""
    honest = [0.3 * (target - theta + 0.5 * torch.randn(D, generator=gen, dtype=torch.float64))
              for _ in HONEST]
    norm = float(torch.stack(honest).norm(dim=1).mean())
    rand = torch.randn(D, generator=gen, dtype=torch.float64)
    flip = -0.3 * (target - theta + 0.5 * torch.randn(D, generator=gen, dtype=torch.float64))
    return torch.stack(honest + [torch.zeros(D, dtype=torch.float64), rand * norm / rand.norm(),
                                 flip])


def _run(aggregator: str, rounds: int = 5, seed: int = 0):
    engine = create_engine("sqlite://", connect_args={"check_same_thread": False},
                           poolclass=StaticPool)
    create_ledger_tables(engine)
    key = Ed25519PrivateKey.from_private_bytes(bytes([7] * 32))
    ledger = Ledger(lambda: Session(engine), key)
    book = ReputationBook(lambda: Session(engine))
    gen = torch.Generator().manual_seed(seed)
    target = torch.randn(D, generator=gen, dtype=torch.float64)
    theta = torch.zeros(D, dtype=torch.float64)
    who = HONEST + BAD
    paid_per_round = []
    for r in range(rounds):
        deltas = _deltas(theta, target, gen)                              # (n, D)
        clip = clip_factors(deltas.norm(dim=1), max_norm=float(deltas.norm(dim=1).median()) * 1.5)
        clipped = deltas * clip[:, None]
        rep_w = aggregation_weights(who, book.values(who), floor=0.05, cap=1.0)
        if aggregator == "multi-krum":
            result = multi_krum(clipped, f=2, weights=rep_w)
        else:
            result = mean(clipped, weights=rep_w)
        dg = result.diagnostics
        diags = [ContributionDiagnostics(selected=bool(dg.selected[i]),
                                         trimmed_share=float(dg.trimmed_share[i]),
                                         clip_factor=float(clip[i]),
                                         krum_score=float(dg.score[i])) for i in range(len(who))]
        w = dg.weight_used

        def subset_loss(s: frozenset[int]) -> float:
            # The aggregator's own weights restricted to the coalition, renormalised.
            idx = sorted(s)
            ws = w[idx]
            if float(ws.sum()) == 0:
                return _loss(theta, target)
            return _loss(theta + (ws[:, None] * clipped[idx]).sum(0) / ws.sum(), target)

        base = _loss(theta, target)
        solo = [_loss(theta + clipped[i], target) for i in range(len(who))]
        scores = score_round(who, base, solo, diags, subset_loss,
                             ScoringConfig(max_evaluations=64),
                             generator=torch.Generator().manual_seed(r))
        settlement = settle_round(round_id=r, scores=scores, pool=POOL, ledger=ledger, book=book)
        paid_per_round.append(settlement.plan.paid_total)
        theta = theta + result.aggregate
    return engine, ledger, book, key, paid_per_round


@pytest.mark.parametrize("aggregator", ["mean", "multi-krum"])
def test_honest_earn_more_bad_earn_nothing_pool_conserved(aggregator):
    engine, ledger, book, key, paid = _run(aggregator)
    balances = {w: ledger.balance(w) for w in HONEST + BAD}
    assert paid == [POOL] * 5                                  # every pool paid out exactly
    assert sum(balances.values()) == 5 * POOL
    assert all(balances[b] == 0 for b in BAD), balances
    assert all(balances[h] > 0 for h in HONEST), balances
    reps = book.values(HONEST + BAD)
    assert min(reps[h] for h in HONEST) > 0.1 > max(reps[b] for b in BAD)
    for w in HONEST + BAD:                                     # balance = sum of its entries
        mine = ledger.entries(contributor=w)
        assert len(mine) == 5
        assert balances[w] == sum(e.amount for e in mine)
        assert verify_entries([e.model_dump() for e in mine], key.public_key()).ok
    assert {e.kind for w in BAD for e in ledger.entries(contributor=w)} == {"refusal"}
    report = verify_chain(ledger.entries(), key.public_key())
    assert (report.ok, report.checked) == (True, 40)
    engine.dispose()


def test_settling_a_round_twice_is_refused_and_tampering_is_caught():
    from zoo_gym.rewards import RoundAlreadySettledError, ScoringConfig

    engine, ledger, book, key, _ = _run("mean", rounds=2)
    scores = score_round(["x"], 1.0, [0.9], [ContributionDiagnostics()], None, ScoringConfig())
    with pytest.raises(RoundAlreadySettledError, match="round 1"):
        settle_round(round_id=1, scores=scores, pool=POOL, ledger=ledger, book=book)
    assert ledger.verify().ok and len(ledger.entries()) == 16
    with engine.begin() as conn:  # pay the attacker behind the ledger's back
        conn.execute(text("UPDATE ledger_entry SET amount = 500 WHERE contributor = 'flip' "
                          "AND round_id = 1"))
    report = ledger.verify()
    assert not report.ok and report.first_bad_seq == 16 and "entry_hash" in report.reason
    engine.dispose()
