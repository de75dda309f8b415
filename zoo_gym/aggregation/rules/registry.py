"""Names to rules, once, at the edge (as Opacus' `create_accountant`): `create_rule(config)`."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from ..errors import SoupConfigError
from .averaging import CenteredClip, GeometricMedian, Mean, TrustMean
from .base import Rule
from .coordinatewise import Median, TrimmedMean
from .selection import Bulyan, Krum, MultiKrum

# read-only: the operator-facing names, in the order the help text lists them
RULES: Mapping[str, type[Rule]] = MappingProxyType({rule.name: rule for rule in (
    Mean, Median, TrimmedMean, Krum, MultiKrum, Bulyan, GeometricMedian, CenteredClip, TrustMean)})


def create_rule(config: Any) -> Rule:
    """The rule `config.aggregator` names, with its settings from the config's (a `SoupConfig`'s) flat fields."""
    try:
        cls = RULES[config.aggregator]
    except KeyError:
        raise SoupConfigError(f"`aggregator` must be one of {', '.join(RULES)}; got "
                              f"{config.aggregator!r}") from None
    return cls.from_config(config)
