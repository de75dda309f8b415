"""Reputation in [0, 1]: an exponential moving average of a contributor's round outcomes.

A new identity starts at ``initial``. Each settled round moves it:

    paid or accepted, target t = min(1, score / median score of the round)  (t = 1 if median 0)
        r <- (1 - alpha) * r + alpha * t
    refused, zero score:  r <- (1 - penalty_alpha) * r

Aggregation weights come from reputation only: ``w_i = clamp(r_i, floor, cap) / sum_j clamp(r_j,
floor, cap)``. Why: docs/design/rewards-scoring.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sqlmodel import Field, Session, SQLModel, select

from .errors import ConfigError

if TYPE_CHECKING:  # torch is imported where it is used: the configs load without it
    import torch


@dataclass(frozen=True)
class ReputationConfig:
    """Reputation dynamics and how it weights the aggregation."""

    initial: float = field(default=0.1, metadata={"help": "reputation of an identity never seen before, [0, 1]"})
    alpha: float = field(default=0.2, metadata={
        "help": "EMA step towards the round's target after a good round, (0, 1]"})
    penalty_alpha: float = field(default=0.5, metadata={
        "help": "EMA step towards 0 after a refused or zero-score round, (0, 1]"})
    floor: float = field(default=0.05, metadata={"help": "smallest aggregation weight before normalising"})
    cap: float = field(default=1.0, metadata={"help": "largest aggregation weight before normalising, [0, 1]"})

    def __post_init__(self) -> None:
        for name in ("initial", "cap"):
            v = getattr(self, name)
            if not 0.0 <= v <= 1.0:
                raise ConfigError(f"`{name}` must be in [0, 1], got {v}")
        for name in ("alpha", "penalty_alpha"):
            v = getattr(self, name)
            if not 0.0 < v <= 1.0:
                raise ConfigError(f"`{name}` must be in (0, 1], got {v}")
        if not 0.0 < self.floor <= self.cap:
            raise ConfigError(f"`floor` must be in (0, cap={self.cap}], got {self.floor}")


def next_reputation(previous: float | None, *, target: float | None,
                    config: ReputationConfig) -> float:
    """One EMA step; ``previous`` None = new identity; ``target`` None = refused / zero score."""
    r = config.initial if previous is None else float(previous)
    if target is None:
        return (1.0 - config.penalty_alpha) * r
    t = min(1.0, max(0.0, float(target)))
    return min(1.0, max(0.0, (1.0 - config.alpha) * r + config.alpha * t))


def aggregation_weights(contributors: Sequence[str], reputations: Mapping[str, float], *,
                        floor: float, cap: float, initial: float = 0.1,
                        dtype: torch.dtype | None = None) -> torch.Tensor:
    """Normalised aggregation weights ``(n,)`` from reputation, clamped to [floor, cap] first.

    Contributors missing from ``reputations`` count as new identities (``initial``); dtype None: float64.
    """
    import torch  # here: reading a ReputationConfig (gym-server status) does not import torch

    dtype = torch.float64 if dtype is None else dtype
    if not 0.0 < floor <= cap:
        raise ConfigError(f"`floor` must be in (0, cap={cap}], got {floor}")
    if not contributors:
        return torch.zeros(0, dtype=dtype)
    raw = []
    for who in contributors:
        r = float(reputations.get(who, initial))
        if not math.isfinite(r):
            raise ConfigError(f"reputation of {who!r} is {r!r}; it must be finite")
        raw.append(min(cap, max(floor, r)))
    w = torch.tensor(raw, dtype=torch.float64)  # (n,)
    return (w / w.sum()).to(dtype)


class ReputationBase(SQLModel):
    value: float = Field(ge=0.0, le=1.0)      # current reputation in [0, 1]
    rounds: int = 0                          # settled rounds this contributor took part in
    updated_round: int = -1                  # last round that moved it


class Reputation(ReputationBase, table=True):
    __tablename__ = "reputation"
    contributor: str = Field(primary_key=True, max_length=128)  # hex public-key id


class ReputationPublic(ReputationBase):
    contributor: str


class ReputationBook:
    """Reputations stored in the `reputation` table; the session comes from the caller."""

    def __init__(self, session_factory: Callable[[], Session],
                 config: ReputationConfig | None = None) -> None:
        self._session_factory = session_factory
        self.config = config or ReputationConfig()

    def values(self, contributors: Iterable[str], *, session: Session | None = None
               ) -> dict[str, float]:
        """Current reputation of each contributor (``initial`` for identities never seen)."""
        wanted = list(contributors)
        rows = self._rows(wanted, session=session)
        return {w: (rows[w].value if w in rows else self.config.initial) for w in wanted}

    def get(self, contributor: str) -> ReputationPublic:
        """The stored row, or a new identity's defaults."""
        with self._session_factory() as session:
            row = session.get(Reputation, contributor)
            if row is None:
                return ReputationPublic(contributor=contributor, value=self.config.initial)
            return ReputationPublic.model_validate(row, from_attributes=True)

    def record(self, values: Mapping[str, float], *, round_id: int,
               session: Session | None = None) -> None:
        """Store new values after ``round_id``; commits unless the caller passed its session."""
        own = session is None
        s = self._session_factory() if own else session
        try:
            rows = self._rows(list(values), session=s)
            for who, v in values.items():
                if not (math.isfinite(v) and 0.0 <= v <= 1.0):
                    raise ConfigError(f"reputation of {who!r} must be in [0, 1], got {v!r}")
                row = rows.get(who) or Reputation(contributor=who, value=v)
                row.value = float(v)
                row.rounds += 1
                row.updated_round = int(round_id)
                s.add(row)
            if own:
                s.commit()
            else:
                s.flush()
        finally:
            if own:
                s.close()

    def _rows(self, contributors: list[str], *, session: Session | None) -> dict[str, Reputation]:
        if not contributors:
            return {}
        stmt = select(Reputation).where(Reputation.contributor.in_(contributors))  # type: ignore[attr-defined]
        if session is not None:
            return {r.contributor: r for r in session.exec(stmt)}
        with self._session_factory() as s:
            out = {r.contributor: r for r in s.exec(stmt)}
            for r in out.values():
                s.expunge(r)
            return out
