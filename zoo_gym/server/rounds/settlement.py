"""The server's side of rewards: score a round, settle it on the ledger, answer balance/ledger queries.

zoo_gym.rewards holds the formulas and the ledger; this module feeds it the server's numbers: held-out losses
on the validation set (its pairs' Bradley-Terry loss when it holds preference pairs: evaluation/preference_scoring.py)
and the round's DeltaSoup report. `scoring-method = "first-order"` (the default, rewards/first_order_scoring.py):
one gradient of the base's loss on a fixed 32-example scoring set, slopes <g, delta_i> from the rows the
aggregation decodes anyway (SlopeTap), the linear Shapley game, a random-direction gate and exact forward passes
for the top 2 only. `"exact"`: 1 + n + (marginal evaluations, at most `scoring-max-evaluations`) forward passes
of base + a subset's report-weighted aggregate (clip factor x selected x untrimmed share: exact for the mean,
the standard linearisation for robust rules); first order falls back to it when a gain passes 1 (past the
linear regime); `scoring-subsets = "rule"` aggregates each subset by the round's rule instead. A byte-identical
copy of an earlier submission is paid nothing. docs/design/rewards-settlement.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, replace
from typing import Any

import torch

from zoo_gym.rewards import (
    ContributionDiagnostics,
    ContributionScore,
    SlopeTap,
    score_round_first_order,
    Ledger,
    ReputationBook,
    aggregation_weights as _rep_weights,
    score_round,
)
from zoo_gym.rewards.settle import SettlementPlan, plan_settlement
from zoo_gym.server.config import ServerConfig
from zoo_gym.server.store.state import ServerState

# Rows the tap keeps (references) for the exact checks: only those the server's StoredDeltas cached (its own 128 MB
# budget), so the references cost no memory; the checks decode the rest again (a tensor of one contributor).
_TAP_KEEP_BYTES = 512 << 20


def _factory(state: ServerState):
    from sqlmodel import Session

    return lambda: Session(state.engine, expire_on_commit=False)


def current_reputations(state: ServerState, config: ServerConfig, contributors: list[str], *,
                        session=None) -> dict[str, float]:
    """Each contributor's reputation now (a new identity's initial value if never settled)."""
    return ReputationBook(_factory(state), config.rewards.settlement.reputation).values(contributors, session=session)


def aggregation_weights(config: ServerConfig, contributors: list[str],
                        reputations: Mapping[str, float]) -> torch.Tensor | None:
    """Reputation weights for the aggregator (never self-reported sample counts); None when disabled.

    `reputations` are the values recorded when the round closed, so a redo weights exactly as the first run.
    """
    if not config.rewards.reputation_weighting:
        return None
    rep = config.rewards.settlement.reputation
    return _rep_weights(contributors, reputations, floor=rep.floor, cap=rep.cap, initial=rep.initial,
                        dtype=torch.float32)


def scoring_tap(config: ServerConfig, source, evaluator):
    """Wrap the round's DeltaSource so first-order slopes are taken from the rows aggregation decodes."""
    if evaluator is None or config.rewards.scoring_method != "first-order":
        return source
    return SlopeTap(source, evaluator.gradient().grad, keep_bytes=_TAP_KEEP_BYTES)


class DescentDirection:
    """The operator's reference direction for trust-mean: minus the gradient of its validation loss at the base,
    read tensor by tensor from the evaluator's (possibly spilled) gradient. The operator's own data, so weighing
    deltas by it costs no contributor's privacy (docs/design/privacy.md)."""

    def __init__(self, grad) -> None:
        self._grad = grad

    def get(self, name: str):
        try:
            g = self._grad[name]
        except KeyError:
            return None
        return -g.float()


def reference_for(config: ServerConfig, evaluator):
    """The reference direction the configured rule weighs deltas by (None when the rule needs none)."""
    if not config.soup.rule.needs_reference:
        return None
    if evaluator is None:
        raise ValueError(f"--aggregator {config.soup.aggregator} needs the validation set's gradient: set "
                         "--validation-examples > 0")
    return DescentDirection(evaluator.gradient().grad)


def plan_rewards(state: ServerState, config: ServerConfig, rnd, source, report, evaluator, *,
                 reputations: Mapping[str, float], payloads: list[tuple[str, str]] | None = None,
                 dp_clip: float | None = None) -> tuple[SettlementPlan | None, dict]:
    """Score every submission of the round and plan its payouts; writes nothing.

    `source` is the DeltaSource the aggregation read (a SlopeTap in first-order mode); `reputations` are
    those recorded when the round closed; `payloads` each submission's (base sha256, payload sha256) in their
    order (a byte-identical copy of an earlier submission against the same base is paid nothing); `dp_clip` the
    clip norm the round's release used (adapted since `--dp-clip`). Returns the plan (None without a
    validation set) and a JSON-able summary for the round's report. `record_settlement` writes the plan
    with the publish.
    """
    if evaluator is None:
        return None, {"skipped": "no validation set"}
    pool, scoring, settle = config.rewards.reward_pool, config.rewards.scoring, config.rewards.settlement
    contribs = report.contributors
    ids = list(source.contributors)
    scales = [c.clip_factor if c.accepted else 1.0 for c in contribs]
    # What of each delta the aggregate actually used, times its aggregation weight.
    used = [c.clip_factor * (1.0 if c.selected else 0.0) * (1.0 - c.trimmed_share) if c.accepted else 0.0
            for c in contribs]
    weights = [max(c.weight, 0.0) * u if c.accepted else 0.0 for c, u in zip(contribs, used)]
    diagnostics = [ContributionDiagnostics(
        accepted=c.accepted, reason=c.reason or "", selected=c.selected,
        trimmed_share=min(max(c.trimmed_share, 0.0), 1.0),
        clip_factor=min(max(c.clip_factor, 1e-12), 1.0) if c.accepted else 1.0,
        krum_score=c.score if c.score is not None else math.nan) for c in contribs]

    def solo_delta(i: int) -> dict[str, torch.Tensor]:
        return {name: source.stacked_one(i, name) for name in source.names()}

    if isinstance(source, SlopeTap):
        slopes, norms = source.result(scales=scales)
        bg = evaluator.gradient()
        result = score_round_first_order(
            ids, base_loss=bg.base_loss, grad_norm=bg.norm, numel=bg.numel, slopes=slopes, norms=norms,
            weights=weights, diagnostics=diagnostics, config=scoring,
            exact_solo_loss=lambda i: evaluator.solo_loss(source.delta_of(i), scale=scales[i]))
        scores, base_loss, method = result.scores, bg.base_loss, "first-order"
        beyond = outside_linear_regime(slopes, base_loss=bg.base_loss, accepted=[c.accepted for c in contribs])
        if beyond:  # the linear game says nothing here: every such gain is capped at 1 (real weights, many steps)
            scores, base_loss = _exact_scores(ids, source, scales, used, weights, diagnostics, scoring, evaluator,
                                              source.delta_of, None)
            method = f"exact (first order outside its linear regime: {beyond})"
    else:
        by_rule = None
        if config.rewards.scoring_subsets == "rule":
            by_rule = RuleSubsets(config, source, aggregation_weights(config, ids, reputations),
                                  reference_for(config, evaluator), payloads, dp_clip=dp_clip)
        scores, base_loss = _exact_scores(ids, source, scales, used, weights, diagnostics, scoring, evaluator,
                                          solo_delta, by_rule)
        method = "exact" if by_rule is None else "exact, subsets by the round's rule"
    scores = first_copies_only(scores, payloads)
    plan = plan_settlement(round_id=rnd.id, scores=scores, reputations=reputations, pool=pool, config=settle)
    summary = {"method": method, "scoring_base_loss": base_loss, "pool": pool,
               "payouts": [asdict(p) for p in plan.payouts], "scores": [asdict(s) for s in scores]}
    if getattr(evaluator, "metric", "loss") == "exact-match":
        summary["scoring_loss"] = "0-1: share of the scoring set's reference answers greedy decoding does not write"
    elif getattr(evaluator, "pairs", None):  # the scoring loss is the pairs' (evaluation/preference_scoring.py)
        summary["scoring_loss"] = "preference: mean -log sigmoid(log p(chosen) - log p(rejected))"
    return plan, summary


def outside_linear_regime(slopes, *, base_loss: float, accepted: list[bool]) -> str:
    """Why first-order scores cannot rank this round ("" when they can): some accepted delta's first-order gain
    -<g, delta>/L0 is at least 1, a predicted loss at or below 0. The linear game caps such gains at 1, so every
    such contributor gets the same solo gain whatever its data (measured on SmolLM2-135M: all honest LoRA deltas,
    a byte-copy and wrong-label data scored alike, benchmarks/results/learning.json); exact losses rank them."""
    gains = [-float(s) / base_loss for s, ok in zip(slopes, accepted) if ok and math.isfinite(float(s))]
    over = [g for g in gains if g >= 1.0]
    return f"{len(over)} of {len(gains)} first-order gains >= 1, largest {max(over):.3g}" if over else ""


def first_copies_only(scores: list, payloads: list[tuple[str, str]] | None) -> list:
    """Scores with every byte-identical copy of an earlier submission (the same payload against the same base)
    set to 0; the earliest is scored as usual. Copying a delta adds nothing to the round, so two identities
    sending one delta are paid once; the first to arrive is the one paid, so a copier cannot take a share of
    its author's pay. The same bytes against another base (an async buffer's stale delta) are another step."""
    if not payloads or len(payloads) != len(scores):
        return scores
    first: dict[tuple[str, str], str] = {}
    out = []
    for s, key in zip(scores, payloads):
        author = first.setdefault(key, s.contributor)
        if author != s.contributor and s.accepted:
            s = replace(s, score=0.0, reason=f"a byte-identical copy of an earlier submission of this round "
                                             f"(by {author}); only the first is paid")
        out.append(s)
    return out


def record_settlement(state: ServerState, config: ServerConfig, plan: SettlementPlan | None, session) -> None:
    """Append the plan's ledger entries and new reputations inside the caller's transaction.

    The caller commits them together with the published checkpoint, so a round is paid exactly when it is
    published. A round the ledger already holds (settled by an older version just before a crash) is not
    paid twice.
    """
    if plan is None:
        return
    settle = config.rewards.settlement
    ledger = Ledger(_factory(state), state.key)
    if ledger.has_round(plan.round_id, session=session):
        return
    ledger.append(plan.entries(), session=session)
    ReputationBook(_factory(state), settle.reputation).record(plan.reputations(), round_id=plan.round_id,
                                                              session=session)


def _exact_scores(ids, source, scales, used, weights, diagnostics, scoring, evaluator, solo_delta, by_rule):
    """Exact losses on the scoring set (`ServerEvaluator.score_loss`: completion or 0-1): 1 + n + (bounded
    marginal) forward passes, and one dense delta per contributor decoded at a time (subsets decode their
    members again). A base that already answers every scoring question exactly leaves nothing to gain: 0 each."""
    base_losses = evaluator.score_losses(None)  # per example (exact match), so each marginal's error is measured
    base_loss = evaluator.score_loss(None) if base_losses is None else float(base_losses.double().mean())
    if base_loss <= 0:
        reason = "the base already answers every scoring question exactly: nothing left to gain on them"
        return [ContributionScore(contributor=c, score=0.0, accepted=d.accepted, reason=reason, solo_gain=0.0,
                                  marginal=0.0, value=0.0, participation=0.0, consensus=1.0, method="none")
                for c, d in zip(ids, diagnostics)], base_loss
    solo = [evaluator.score_loss(solo_delta(i), scale=scales[i]) for i in range(len(ids))]

    def loss_of(merged):
        return evaluator.score_loss(merged) if base_losses is None else evaluator.score_losses(merged)

    def subset_loss(subset: frozenset[int]):
        if by_rule is not None:
            merged = by_rule.aggregate(sorted(subset))
            if merged is not None:
                return loss_of(merged)
        members = [i for i in subset if used[i] > 0 and weights[i] > 0]
        total = sum(weights[i] for i in members)
        if total <= 0:
            return base_loss if base_losses is None else base_losses
        merged: dict[str, torch.Tensor] = {}
        for i in members:
            for k, v in solo_delta(i).items():
                merged[k] = merged.get(k, 0) + v * (weights[i] / total)
        return loss_of(merged)

    return score_round(ids, base_loss, solo, diagnostics, subset_loss, scoring, base_losses=base_losses), base_loss


class RuleSubsets:
    """The round's own rule over a subset of its submissions, as the round would have published it without them:
    its SoupConfig with DP noise off (scoring spends no privacy budget), its reputation weights and reference.
    A delta's content is its earliest byte copy's: later copies are in no subset, so leaving the author out
    leaves the content out (a copier cannot zero its author's leave-one-out value) and a copy adds nothing."""

    def __init__(self, config: ServerConfig, source, weights: torch.Tensor | None, reference,
                 payloads: list[tuple[str, str]] | None, *, dp_clip: float | None = None) -> None:
        self.dp_clip = dp_clip  # the clip the release used (adaptive clipping moves it from the configured one)
        self.soup = replace(config.soup, dp_noise_multiplier=0.0, dp_target_epsilon=None,
                            dp_adaptive_clip=False, min_contributors=1)
        self.source, self.weights, self.reference = source, weights, reference
        keys = payloads if payloads and len(payloads) == len(source.contributors) else []
        self.later_copies = {j for j, key in enumerate(keys) if key in keys[:j]}

    def aggregate(self, members: list[int]) -> dict[str, torch.Tensor] | None:
        """{name: tensor} of the rule over `members` (indices into the round), or None when the rule cannot run
        on so few (the caller takes the weighted mean)."""
        from zoo_gym.aggregation import DeltaSoup
        from zoo_gym.aggregation.errors import AggregationError, SoupConfigError
        from zoo_gym.aggregation.sources import SubsetSource

        members = [i for i in members if i not in self.later_copies]
        if not members:
            return None
        out: dict[str, torch.Tensor] = {}
        sub = SubsetSource(self.source, members)
        w = self.weights[members] if self.weights is not None else None
        try:
            DeltaSoup(self.soup, dp_clip=self.dp_clip).run(sub, lambda name, t: out.__setitem__(name, t.reshape(sub.shape(name)).clone()),
                                     weights=w, reference=self.reference, generator=torch.Generator().manual_seed(0))
        except (AggregationError, SoupConfigError):
            return None
        return out


def balance_of(state: ServerState, contributor_id: str) -> dict[str, Any]:
    from zoo_gym.server.errors import InvalidArgument

    if not contributor_id:
        raise InvalidArgument("contributor_id is required")
    ledger = Ledger(_factory(state), state.key)
    entries = ledger.entries(contributor=contributor_id)
    book = ReputationBook(_factory(state))
    return {"balance": ledger.balance(contributor_id), "reputation": float(book.get(contributor_id).value),
            "entries": len(entries), "last_seq": entries[-1].seq if entries else 0}


def ledger_entries(state: ServerState, *, contributor: str | None, since_seq: int, limit: int | None) -> list[dict]:
    ledger = Ledger(_factory(state), state.key)
    out = []
    for e in ledger.entries(contributor=contributor, since_seq=since_seq, limit=limit):
        d = e.model_dump()
        d["contributor_id"] = d.pop("contributor")
        out.append(d)
    return out


__all__ = ["aggregation_weights", "balance_of", "current_reputations", "ledger_entries", "plan_rewards",
           "record_settlement", "scoring_tap"]
