"""Typed errors of the rewards library; every message says what to change."""

from __future__ import annotations


class RewardsError(Exception):
    """Base class of every error raised by `zoo_gym.rewards`."""


class ConfigError(RewardsError, ValueError):
    """A config field is out of range; the message names the field."""


class ScoringInputError(RewardsError, ValueError):
    """The inputs of `score_round` do not fit together (lengths, non-finite losses, ...)."""


class SplitError(RewardsError, ValueError):
    """`split_pool` got a negative pool, negative/non-finite weights or duplicate contributors."""


class LedgerError(RewardsError):
    """The ledger refused an append (bad entry, conflicting writer, round already settled)."""


class LedgerConflictError(LedgerError):
    """Another writer appended at the same sequence number; nothing was written: retry."""


class RoundAlreadySettledError(LedgerError):
    """The ledger already holds entries for this round; settling twice would pay twice."""
