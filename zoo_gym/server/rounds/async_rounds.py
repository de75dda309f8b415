"""Asynchronous buffered rounds (`--mode async`): FedBuff under a robust rule, with FedAsync's staleness weight.

Sources: FedBuff (Nguyen et al., AISTATS 2022) for the buffer and the server learning rate; FedAsync (Xie et
al., 2019) for w(s) = (1 + s) ** -staleness_exponent. Round r is version r; a delta may name any of the last
max_staleness bases. Every K deltas the buffer flushes through the synchronous publish path. The mean takes w(s)
as aggregation weights; every robust rule, and any rule under DP, aggregates the weighted rows w(s) x delta.
Version r = base + server_lr x step_scale x aggregate. What a flush used is recorded when its buffer closes
(`Staleness`), so a redo is exact; a stale delta is paid amount x w(s), never refused for being slow.
Design reasoning: docs/design/async-rounds.md.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from sqlmodel import select

from zoo_gym.aggregation import SoupConfig
from zoo_gym.server.config import ServerConfig
from zoo_gym.server.errors import FailedPrecondition
from zoo_gym.server.store.models import Round, RoundInputs, RoundState, Submission

if TYPE_CHECKING:  # torch is imported where used: `gym-server status` reads the mode without it
    import torch



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
    """How many rows Multi-Krum averages in an async flush of `buffer_size` deltas, as the rule sizes itself per
    buffer (`MultiKrum.per_buffer`: the configured `multi-krum-m`, else K // 2); None for the other rules."""
    return soup.rule.per_buffer(buffer_size).get("multi_krum_m")


def staleness_applied(soup: SoupConfig) -> str:
    """How a flush under `soup` applies w(s): "weights" (aggregation weights on the deltas as submitted: a rule
    whose `staleness_as_weights`, no DP) or "rows" (each row multiplied by its weight first)."""
    return "weights" if soup.rule.staleness_as_weights and not soup.dp_enabled else "rows"


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


def recorded_mode(session) -> dict:
    """The serve mode as the latest closed round recorded it (for `gym-server status`): {"mode": "sync" |
    "async" | None (no round closed yet), "as_of_round", and in async the buffer size, max staleness, server
    learning rate and staleness exponent (None where a round closed by an older version did not record it)}."""
    inputs = session.exec(select(RoundInputs).order_by(RoundInputs.round_id.desc())).first()
    if inputs is None:
        return {"mode": None, "as_of_round": None}
    recorded = json.loads(inputs.staleness_json) if inputs.staleness_json else None
    if recorded is None:
        return {"mode": "sync", "as_of_round": inputs.round_id, "server_lr": inputs.server_lr}
    keys = ("buffer_size", "max_staleness", "server_lr", "staleness_exponent")
    return {"mode": "async", "as_of_round": inputs.round_id, **{k: recorded.get(k) for k in keys}}


def describe_mode(mode: dict) -> str:
    """One line for `gym-server status` from `recorded_mode`."""
    if mode["mode"] is None:
        return "mode: not recorded yet (a round records the serve mode when it closes)"
    when = f"as round {mode['as_of_round']} closed"
    if mode["mode"] == "sync":
        lr = mode.get("server_lr")
        return f"mode: sync ({when})" if lr in (None, 1.0) else f"mode: sync, server lr {lr:g} ({when})"
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
        import torch

        self.contributors = source.contributors
        self._w = torch.tensor(weights, dtype=torch.float32)  # (n,)

    def names(self):
        return self._source.names()

    def shape(self, name: str):
        return self._source.shape(name)

    def stacked(self, name: str) -> torch.Tensor:
        return self._source.stacked(name) * self._w[:, None]  # (n, numel)

    @property
    def reads_blocks(self) -> bool:
        return getattr(self._source, "stacked_block", None) is not None and getattr(self._source, "reads_blocks", True)

    def stacked_block(self, name: str, start: int, stop: int, *, out: torch.Tensor | None = None) -> torch.Tensor:
        x = self._source.stacked_block(name, start, stop, out=out)  # (n, stop - start)
        return x.mul_(self._w[:, None]) if x is out else x * self._w[:, None]

    def packed(self, name: str):
        return None

    def sq_norms(self, name: str):
        inner = getattr(self._source, "sq_norms", None)
        known = inner(name) if inner is not None else None
        if known is None:
            return None
        sq, numel = known
        return sq * self._w.double() ** 2, numel


@dataclass(frozen=True)
class Staleness:
    """What a flush recorded when its buffer closed (RoundInputs.staleness_json), exactly as stored: the
    published lineage carries `recorded`; flushes recorded before a field existed read its old meaning."""

    recorded: dict

    @classmethod
    def parse(cls, text: str | None) -> Staleness | None:
        return cls(json.loads(text)) if text else None

    @property
    def applied(self) -> str:
        return self.recorded.get("staleness_applied", "rows")

    @property
    def step(self) -> float:
        """server_lr x step_scale, the factor on the aggregate."""
        return float(self.recorded["server_lr"]) * float(self.recorded.get("step_scale", 1.0))

    @property
    def multi_krum_m(self) -> int | None:
        m = self.recorded.get("multi_krum_m")
        return None if m is None else int(m)

    def contributor(self, cid: str) -> dict:
        return self.recorded["contributors"][cid]

    def weights(self, contributors: list[str]) -> list[float]:
        return [float(self.contributor(c)["weight"]) for c in contributors]


class SyncFlush:
    """A synchronous round: the rule and the pay as configured; the aggregate x the recorded server lr."""

    adjusts_pay = False

    def __init__(self, server_lr: float | None = None) -> None:
        self.server_lr = 1.0 if server_lr is None else float(server_lr)  # None: closed before it was recorded

    def soup(self, soup: SoupConfig) -> SoupConfig:
        return soup

    def rows(self, source, contributors: list[str], weights):
        return source, weights

    def sink(self, sink: Callable[[str, torch.Tensor], None]):
        lr = self.server_lr
        return sink if lr == 1.0 else (lambda name, agg: sink(name, agg * lr))

    def payouts(self, plan, *, pool: int):
        return plan

    def lineage(self) -> dict:
        return {} if self.server_lr == 1.0 else {"server_lr": self.server_lr}


class StalenessFlush:
    """An async flush: the rule, rows, step and pay adjusted by the staleness recorded at close."""

    adjusts_pay = True

    def __init__(self, staleness: Staleness) -> None:
        self.staleness = staleness

    def soup(self, soup: SoupConfig) -> SoupConfig:
        """Multi-Krum's m as recorded when the buffer closed (a flush that recorded none: the configured soup)."""
        m = self.staleness.multi_krum_m
        return soup if m is None else replace(soup, multi_krum_m=m)

    def rows(self, source, contributors: list[str], weights):
        """(source, weights) for DeltaSoup.run: weighted rows ("rows"), or the rows as submitted with weights
        x w(s) ("weights"; `weights` None: w(s) alone)."""
        w = self.staleness.weights(contributors)
        if self.staleness.applied == "rows":
            return (source if all(x == 1.0 for x in w) else StalenessScaled(source, w)), weights
        import torch

        wt = torch.tensor(w, dtype=torch.float64)
        return source, wt if weights is None else torch.as_tensor(weights, dtype=torch.float64) * wt

    def sink(self, sink: Callable[[str, torch.Tensor], None]):
        """`sink` receiving server_lr x step_scale x each aggregated tensor."""
        lr = self.staleness.step
        return sink if lr == 1.0 else (lambda name, agg: sink(name, agg * lr))

    def payouts(self, plan, *, pool: int):
        """Each amount and score x its delta's w(s) (amount rounded down; the rest unpaid), every reason naming
        the flush, the staleness and the weight. Who is paid and the reputations come from the raw scores."""
        if plan is None:
            return plan
        payouts = []
        for p in plan.payouts:
            st = self.staleness.contributor(p.contributor)
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

    def lineage(self) -> dict:
        return {"async": self.staleness.recorded}


def flush_for(staleness_json: str | None, *, server_lr: float | None = None) -> SyncFlush | StalenessFlush:
    """The adjustments of a round as recorded when it closed (no staleness recorded: a synchronous round, whose
    aggregate is multiplied by the recorded `server_lr`; an async flush has its own in the staleness)."""
    staleness = Staleness.parse(staleness_json)
    return SyncFlush(server_lr) if staleness is None else StalenessFlush(staleness)
