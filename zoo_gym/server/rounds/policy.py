"""Sync and async rounds as two policies, one chosen when the server starts (`policy_for(config)`).

A policy says when an open round closes, how many submissions it holds (and so where one is stored), whether
it has a deadline, which bases a submission may name, what is recorded with the round when it closes, what
RoundInfo says of the mode, and which setting bounds the round's size for the robust rule. Nothing else in the
server tests the mode.
"""

from __future__ import annotations

import time

from zoo_gym.server.config import ServerConfig, check_round_size
from zoo_gym.server.errors import AlreadyExists, FailedPrecondition
from zoo_gym.server.rounds import async_rounds
from zoo_gym.server.store.models import Round, RoundState, Submission
from sqlmodel import func, select


def deadline_passed(rnd: Round) -> bool:
    return rnd.deadline_unix > 0 and time.time() >= rnd.deadline_unix


def _one_per_round(s, rnd: Round, contributor_id: str) -> None:
    if s.exec(select(Submission.id).where(Submission.round_id == rnd.id,
                                         Submission.contributor_id == contributor_id)).first() is not None:
        raise AlreadyExists(f"contributor {contributor_id} already has an accepted submission in round {rnd.id}")


class SyncRounds:
    """Rounds close at quorum, or at their deadline with min_contributors (fewer when the rule can run)."""

    name = "sync"
    has_deadline = True

    def __init__(self, config: ServerConfig) -> None:
        self.config = config

    def ready(self, rnd: Round, n: int) -> bool:
        return n >= rnd.needs and (n >= self.config.effective_quorum or (
            deadline_passed(rnd) and n >= self.config.min_contributors))

    def timed_out(self, rnd: Round) -> bool:
        """The deadline passed short of min_contributors: the manager closes with fewer or extends."""
        return deadline_passed(rnd)

    def holds(self, rnd: Round) -> int | None:
        return None  # every submission stored when the round closes

    def stored_under(self, s, rnd: Round) -> int:
        """The round a submission taken now is stored under (and acknowledged with): the open one."""
        return rnd.id

    def check_base(self, s, rnd: Round | None, *, round_id: int, base_sha256: str, contributor_id: str) -> None:
        if rnd is None or rnd.id != round_id or rnd.state != RoundState.OPEN:
            current = f"round {rnd.id} is {rnd.state.value}" if rnd else "no round exists"
            raise FailedPrecondition(f"round {round_id} is not open for submissions ({current}); "
                                     "fetch the current round and train on its base")
        if base_sha256 != rnd.base_sha256:
            raise FailedPrecondition(f"the delta is relative to base {base_sha256[:12]}..., but round {rnd.id} "
                                     f"trains on {rnd.base_sha256[:12]}...: download the current base and retrain")
        _one_per_round(s, rnd, contributor_id)

    def record(self, session, round_id: int) -> str | None:
        return None

    def round_info(self) -> dict:
        """A server lr other than 1 is shown (and signed) in RoundInfo; at 1 the fields are as before it existed."""
        return {} if self.config.server_lr == 1.0 else {"server_lr": self.config.server_lr}

    def check_size(self) -> None:
        check_round_size(self.config.soup, self.config.min_contributors)


class AsyncRounds:
    """A round is a buffer of exactly buffer_size deltas against any of the last max_staleness bases."""

    name = "async"
    has_deadline = False

    def __init__(self, config: ServerConfig) -> None:
        self.config = config

    def ready(self, rnd: Round, n: int) -> bool:
        return n >= self.holds(rnd)

    def timed_out(self, rnd: Round) -> bool:
        return False

    def holds(self, rnd: Round) -> int:
        return max(rnd.needs, self.config.buffer_size)

    def stored_under(self, s, rnd: Round) -> int:
        """The round a delta taken now is stored under (and acknowledged with): the open buffer, or the next one
        when this one already holds its K (a delta landing between the manager's count and its close), where
        closing the buffer would move it anyway."""
        held = s.exec(select(func.count()).select_from(Submission).where(Submission.round_id == rnd.id)).one()
        return rnd.id if held < self.holds(rnd) else rnd.id + 1

    def check_base(self, s, rnd: Round | None, *, round_id: int, base_sha256: str, contributor_id: str) -> None:
        async_rounds.check_base(s, rnd, round_id=round_id, base_sha256=base_sha256,
                                max_staleness=self.config.max_staleness)
        _one_per_round(s, rnd, contributor_id)

    def record(self, session, round_id: int) -> str:
        return async_rounds.record_staleness(session, round_id, self.config)

    def round_info(self) -> dict:
        c = self.config
        return {"buffer_size": c.buffer_size, "max_staleness": c.max_staleness,
                "staleness_exponent": c.staleness_exponent, "server_lr": c.server_lr}

    def check_size(self) -> None:
        check_round_size(self.config.soup, self.config.buffer_size, flag="--buffer-size")


POLICIES = {"sync": SyncRounds, "async": AsyncRounds}


def policy_for(config: ServerConfig) -> SyncRounds | AsyncRounds:
    """The policy of `config.mode`, built once at the edge."""
    return POLICIES[config.mode](config)
