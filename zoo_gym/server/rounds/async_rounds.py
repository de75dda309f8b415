"""Asynchronous buffered rounds (`gym-server serve --mode async`): FedBuff under a robust rule.

Sources: FedBuff (Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation", AISTATS
2022) for the buffer and the server learning rate; FedAsync (Xie et al., "Asynchronous Federated
Optimization", 2019) for the polynomial staleness weight.

A round is a *version*: round r trains on version r - 1 (its base) and, when it flushes, publishes
version r. A contributor may submit a delta against the base of any round r - s with
0 <= s <= max_staleness (SubmitHeader.round_id names that round, base_sha256 its base); s is the
delta's *staleness*, the number of versions published since its base. The delta is stored in the open
round's buffer. An older base is FAILED_PRECONDITION naming the current version.

Every `buffer_size` (K) accepted deltas the round closes and publishes through the synchronous path
(rounds.py -> publish.py -> settlement.py), so a flush keeps everything a round guarantees: signed
submissions, durable before acknowledged, one transaction per publish, an exact redo after a crash.
What differs, with w(s) = (1 + s) ** -staleness_exponent (FedAsync's "polynomial" weight):

    the mean (STALENESS_AS_WEIGHTS), without DP ("weights"):
        aggregate  = mean(delta_1 .. delta_K; weights = reputation_i x w(s_i))
        scale      = 1   (staleness_normalize, the default)   or   sum_i w(s_i) / K   (FedBuff's sum / K)
    every robust rule, and every rule under DP ("rows"):
        aggregate  = rule(w(s_1) delta_1 .. w(s_K) delta_K; weights = reputation_i)
        scale      = K / sum_i w(s_i)   (staleness_normalize)   or   1
    version r  = base_{r-1} + server_lr x scale x aggregate                         (FedBuff's eta)

Either way the mean's step is the staleness-weighted *average* sum_i w_i delta_i / sum_i w_i by default
(the normalised weighting of asynchronous FL such as Chen et al., "Asynchronous Online Federated Learning
for Edge Devices with Non-IID Data", 2020): the weights set each delta's share of the step, and a buffer of
stale deltas does not take a step shrunk by their mean weight. A robust rule selects and trims on the
weighted rows it averages: a row's share is its count share, so an attacker who always claims the newest
base (weight 1) cannot hide among the deltas as submitted and then outweigh the stale honest ones it hid
among (with weights, ALIE's colluding rows took 0.4-0.97 of Multi-Krum's step). Under DP the rows stay weighted
before clipping (w <= 1, so a weighted row is never longer than the one submitted and the sensitivity is
the clip C; DeltaSoup makes the weights uniform there) and scale is 1: it would depend on who is in the
buffer, and the noise is calibrated for the 1/K step. Which of the two a flush used, and its scale, are
recorded when the buffer closes (`staleness_applied`, `step_scale`; the sum runs over every delta in the
buffer as it closed, refused ones included), so a redo merges exactly as the first run did; a flush
recorded before `staleness_applied` existed is redone with weighted rows.

Stale deltas are applied to the current base, as FedBuff does. The staleness and the weights are
recorded in RoundInputs.staleness_json when the buffer closes, so a redo merges and pays exactly what
the first run did.

Pay: a delta is scored and its share of the pool split as in a synchronous round (acceptance and
reputation from its own score, so being slow never makes it refused); then its amount and score are
multiplied by w(s) (the amount rounded down; the rest stays unpaid): a stale delta within
max_staleness is paid less than the same delta fresh, never refused for being slow. Its ledger
entry's reason names the flush, its staleness and its weight.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import replace

import torch
from sqlmodel import select

from zoo_gym.aggregation import SoupConfig
from zoo_gym.server.config import ServerConfig
from zoo_gym.server.errors import FailedPrecondition
from zoo_gym.server.store.models import Round, RoundInputs, RoundState, Submission

# Rules for which a delta's staleness is an aggregation weight (DeltaSoup's `weights=`): the mean, whose result
# is the same staleness-weighted average either way, but whose rows then reach DeltaSoup as submitted (LoRA
# factors: one matmul, no dense rows; validation checks the norms as submitted). Every other rule keeps
# weighted rows, so that it selects and trims on what it averages: with weights, Multi-Krum chose the
# colluding ALIE rows (inside the honest deltas' spread) and then gave each, claiming the newest base, 8 to
# 27 times the weight of an honest delta one or two versions stale (0.4-0.97 of the step: ALIE 1.42x its
# clean loss); on weighted rows a row's share is its count share, as in a synchronous round. The median and
# Bulyan take no weights; the geometric median and centered clipping are robust while the outliers' total
# WEIGHT is below one half (benchmarks/async.py, README "Asynchronous rounds: measured").
STALENESS_AS_WEIGHTS = frozenset({"mean"})


def staleness_weight(staleness: int, *, exponent: float) -> float:
    """w(s) = (1 + s) ** -exponent: 1 for a fresh delta, decreasing in s (0 exponent: no discount)."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0 versions, got {staleness}")
    return float((1.0 + staleness) ** -exponent)


def check_base(s, current: Round | None, *, round_id: int, base_sha256: str, max_staleness: int) -> int:
    """The staleness of a delta trained on round `round_id`'s base, or FailedPrecondition saying why not."""
    if current is None or current.state != RoundState.OPEN:
        state = f"round {current.id} is {current.state.value}" if current else "no round exists"
        raise FailedPrecondition(f"no buffer is open for submissions ({state}); submit again once the next "
                                 "version is published")
    version = current.id - 1
    if round_id > current.id:
        raise FailedPrecondition(f"round {round_id} does not exist yet: the current version is {version} "
                                 f"(round {current.id}); fetch the current round")
    staleness = current.id - round_id
    if staleness > max_staleness:
        raise FailedPrecondition(f"the delta's base (round {round_id}) is {staleness} versions old and this server "
                                 f"accepts at most {max_staleness}: the current version is {version} (round "
                                 f"{current.id}); download it and retrain")
    named = current if staleness == 0 else s.get(Round, round_id)
    if named is None or named.base_sha256 != base_sha256:
        trained = named.base_sha256[:12] + "..." if named is not None else "nothing"
        raise FailedPrecondition(f"the delta is relative to base {base_sha256[:12]}..., but round {round_id} trained "
                                 f"on {trained}: name the round whose base you trained on (the current version is "
                                 f"{version}, round {current.id})")
    return staleness


def record_staleness(session, round_id: int, config: ServerConfig) -> str:
    """The JSON recorded in RoundInputs.staleness_json when a buffer closes: the serve mode's settings (buffer
    size, max staleness, server learning rate, exponent; `gym-server status` shows them) and per contributor
    the round its base came from, its staleness and its weight."""
    subs = list(session.exec(select(Submission).where(Submission.round_id == round_id).order_by(Submission.id)))
    contributors = {}
    for sub in subs:
        base_round = session.exec(select(Round.id).where(Round.base_sha256 == sub.base_sha256, Round.id <= round_id)
                                  .order_by(Round.id.desc())).first()
        staleness = round_id - (base_round if base_round is not None else round_id)
        contributors[sub.contributor_id] = {"base_round": base_round, "staleness": staleness,
                                            "weight": staleness_weight(staleness, exponent=config.staleness_exponent)}
    soup = config.soup
    normalize = config.staleness_normalize and not soup.dp_enabled
    applied = staleness_applied(soup)
    weights = [c["weight"] for c in contributors.values()]
    return json.dumps({"buffer_size": config.buffer_size, "max_staleness": config.max_staleness,
                       "server_lr": config.server_lr, "staleness_exponent": config.staleness_exponent,
                       "staleness_normalize": normalize, "staleness_applied": applied,
                       "multi_krum_m": buffer_multi_krum_m(soup, config.buffer_size),
                       "step_scale": step_scale(weights, normalize=normalize, applied=applied),
                       "contributors": contributors}, sort_keys=True)


def buffer_multi_krum_m(soup: SoupConfig, buffer_size: int) -> int | None:
    """How many rows Multi-Krum averages in an async flush: the configured `multi-krum-m`, else K // 2 (None
    for other rules). Not n - f as in a round: f per buffer is the attackers' average share, not a bound
    (one delta per contributor per buffer, so a buffer can hold all of them), and with m = n - f every
    attacker past K - m is averaged in whatever its score. With m = K // 2 none is forced in while they are
    at most half the buffer (benchmarks/async.py: attackers got no weight in any of 32 publishes under sign
    flip and scaling, against 9 of 9 over-f buffers with n - f). Krum's own bound n >= 2f + 3 keeps
    K // 2 <= n - f."""
    if soup.aggregator != "multi-krum":
        return None
    return soup.multi_krum_m if soup.multi_krum_m is not None else max(1, buffer_size // 2)


def flush_soup(soup: SoupConfig, staleness: dict | None) -> SoupConfig:
    """The soup a flush aggregates with: Multi-Krum's m as recorded when its buffer closed (a flush recorded
    before m was recorded, and a synchronous round, keep the configured soup, so a redo is exact)."""
    m = staleness.get("multi_krum_m") if staleness is not None else None
    return soup if m is None else replace(soup, multi_krum_m=int(m))


def staleness_applied(soup: SoupConfig) -> str:
    """How a flush under `soup` applies w(s): "weights" (aggregation weights on the deltas as submitted: a rule
    in STALENESS_AS_WEIGHTS, no DP) or "rows" (each row multiplied by its weight first)."""
    return "weights" if soup.aggregator in STALENESS_AS_WEIGHTS and not soup.dp_enabled else "rows"


def step_scale(weights: list[float], *, normalize: bool, applied: str = "rows") -> float:
    """What the aggregate is multiplied by besides server_lr, from the buffer's K staleness weights (each in
    (0, 1]): with weighted rows K / sum w when normalising (in [1, 1 / min weight]), else 1; with weights the
    rule already averages (1 when normalising), else FedBuff's sum / K, sum w / K (in (0, 1])."""
    if applied not in ("rows", "weights"):
        raise ValueError(f"staleness is applied as 'rows' or 'weights', got {applied!r}")
    if not weights or normalize == (applied == "weights"):
        return 1.0
    ratio = len(weights) / math.fsum(weights)
    return float(ratio if applied == "rows" else 1.0 / ratio)


def parse(staleness_json: str | None) -> dict | None:
    return json.loads(staleness_json) if staleness_json else None


def recorded_mode(session) -> dict:
    """The serve mode as the latest closed round recorded it (for `gym-server status`): {"mode": "sync" |
    "async" | None (no round closed yet), "as_of_round", and in async the buffer size, max staleness, server
    learning rate and staleness exponent (None where a round closed by an older version did not record it)}."""
    inputs = session.exec(select(RoundInputs).order_by(RoundInputs.round_id.desc())).first()
    if inputs is None:
        return {"mode": None, "as_of_round": None}
    recorded = parse(inputs.staleness_json)
    if recorded is None:
        return {"mode": "sync", "as_of_round": inputs.round_id}
    keys = ("buffer_size", "max_staleness", "server_lr", "staleness_exponent")
    return {"mode": "async", "as_of_round": inputs.round_id, **{k: recorded.get(k) for k in keys}}


def describe_mode(mode: dict) -> str:
    """One line for `gym-server status` from `recorded_mode`."""
    if mode["mode"] is None:
        return "mode: not recorded yet (a round records the serve mode when it closes)"
    when = f"as round {mode['as_of_round']} closed"
    if mode["mode"] == "sync":
        return f"mode: sync ({when})"
    shown = lambda v: "not recorded" if v is None else f"{v:g}"  # noqa: E731
    return (f"mode: async, buffer size {shown(mode['buffer_size'])}, max staleness {shown(mode['max_staleness'])}, "
            f"server lr {shown(mode['server_lr'])}, staleness weight (1+s)^-{shown(mode['staleness_exponent'])} "
            f"({when})")


class StalenessScaled:
    """DeltaSource whose row i is weight_i x the wrapped source's row i (zoo_gym.aggregation.DeltaSource).

    For staleness_applied "rows" (every rule but the mean, and DP): the robust rule, clipping and DP noise see
    the weighted rows, as in FedBuff. Weights are <= 1, so a
    weighted delta is never longer than the one submitted and the DP sensitivity bound (the clip) holds.
    The packed BitDelta fast path is not offered (its scales would need the weights): distances are then
    computed from the decoded rows."""

    def __init__(self, source, weights: list[float]) -> None:
        self._source = source
        self.contributors = source.contributors
        self._w = torch.tensor(weights, dtype=torch.float32)  # (n,)

    def names(self):
        return self._source.names()

    def shape(self, name: str):
        return self._source.shape(name)

    def stacked(self, name: str) -> torch.Tensor:
        return self._source.stacked(name) * self._w[:, None]  # (n, numel)

    def packed(self, name: str):
        return None

    def sq_norms(self, name: str):
        inner = getattr(self._source, "sq_norms", None)
        known = inner(name) if inner is not None else None
        if known is None:
            return None
        sq, numel = known
        return sq * self._w.double() ** 2, numel


def weighted_source(source, contributors: list[str], staleness: dict | None):
    """`source` with each row weighted by its staleness weight (unchanged when every weight is 1)."""
    if staleness is None:
        return source
    weights = [float(staleness["contributors"][c]["weight"]) for c in contributors]
    if all(w == 1.0 for w in weights):
        return source
    return StalenessScaled(source, weights)


def apply_staleness(source, contributors: list[str], staleness: dict | None, weights):
    """(source, weights) for DeltaSoup.run as the flush recorded (`staleness_applied`): the deltas as submitted
    and weights x w(s) ("weights"; `weights` None: w(s) alone), or weighted rows and `weights` unchanged ("rows",
    and every flush recorded before the field existed). Sync rounds (staleness None): both unchanged."""
    if staleness is None or staleness.get("staleness_applied", "rows") == "rows":
        return weighted_source(source, contributors, staleness), weights
    w = torch.tensor([float(staleness["contributors"][c]["weight"]) for c in contributors], dtype=torch.float64)
    return source, w if weights is None else torch.as_tensor(weights, dtype=torch.float64) * w


def server_lr_sink(sink: Callable[[str, torch.Tensor], None], staleness: dict | None):
    """`sink` receiving server_lr x step_scale x each aggregated tensor, both as recorded when the buffer
    closed (unchanged in sync mode, or when both are 1; a flush recorded before step_scale existed: 1)."""
    lr = 1.0 if staleness is None else float(staleness["server_lr"]) * float(staleness.get("step_scale", 1.0))
    if lr == 1.0:
        return sink
    return lambda name, agg: sink(name, agg * lr)


def discount_payouts(plan, staleness: dict | None, *, pool: int):
    """The settlement plan with each amount scaled by its delta's staleness weight (floor of amount x w;
    what that withholds stays unpaid), its score likewise, and every entry's reason naming the flush, the
    delta's staleness and its weight. Who is paid and the reputations are the plan's own, from the raw
    scores: a stale delta is paid less than the same delta fresh, never refused for being slow."""
    if plan is None or staleness is None:
        return plan
    info: Mapping[str, dict] = staleness["contributors"]
    payouts = []
    for p in plan.payouts:
        st = info[p.contributor]
        w = float(st["weight"])
        amount = int(math.floor(p.amount * w + 1e-9))  # w = 1: exactly the amount
        tag = (f"flush of version {plan.round_id}: staleness {st['staleness']} (trained on the base of round "
               f"{st['base_round']}), weight {w:.4g}")
        if p.paid:
            reason = (f"paid {amount} of {pool}: score {p.score:.4g} x reputation {p.reputation_before:.3g} "
                      f"gave {p.amount}, x staleness weight {w:.4g}; {tag}")
        else:
            reason = f"{p.reason}; {tag}"
        payouts.append(replace(p, amount=amount, score=p.score * w, reason=reason))
    return replace(plan, payouts=payouts)
