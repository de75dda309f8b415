"""Typed errors of the aggregation library.

Every error says which argument or field is wrong and what would be accepted, so that a
person reading a server log can act on it without opening this code.
"""

from __future__ import annotations


class AggregationError(ValueError):
    """Base class: the inputs or options of an aggregator cannot give a meaningful result."""


class NotRobustConfigError(AggregationError):
    """The requested robustness (e.g. `f` Byzantine contributors) is impossible with `n` inputs."""


class InvalidDeltaError(AggregationError):
    """A delta stack has the wrong shape or dtype, or contains non-finite values."""


class SoupConfigError(ValueError):
    """A `SoupConfig` field (or config-file key) is invalid; the message names the field."""


class PrivacyBudgetExceeded(RuntimeError):
    """Publishing this round would spend more than `dp_target_epsilon`.

    Raised by `DeltaSoup.run` before any output tensor is produced, so nothing that would
    overspend is ever published. Attributes carry the numbers for the server's status line.
    """

    def __init__(self, *, epsilon_spent: float, epsilon_if_published: float, target: float,
                 delta: float) -> None:
        self.epsilon_spent = epsilon_spent
        self.epsilon_if_published = epsilon_if_published
        self.target = target
        self.delta = delta
        super().__init__(
            f"privacy budget exhausted: publishing this round would raise epsilon from "
            f"{epsilon_spent:.4f} to {epsilon_if_published:.4f} (delta={delta:g}), above "
            f"--dp-target-epsilon={target:g}; the server stops publishing. Raise the target "
            f"or the noise multiplier to continue."
        )
