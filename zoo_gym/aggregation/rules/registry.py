"""Names to rules (as Opacus' accountant registry): `register_rule(cls)` adds a `Rule` class under its
`name`, once; `RULES` is the read-only view; `create_rule(config)` builds the one a config names."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, TypeVar

from ..errors import SoupConfigError
from .averaging import CenteredClip, GeometricMedian, Mean, TrustMean
from .base import Rule
from .coordinatewise import Median, TrimmedMean
from .selection import Bulyan, Krum, MultiKrum

R = TypeVar("R", bound=type[Rule])

_RULES: dict[str, type[Rule]] = {}
# read-only: the operator-facing names, in registration order (the built-ins in the order the help lists them)
RULES: Mapping[str, type[Rule]] = MappingProxyType(_RULES)


def register_rule(cls: R) -> R:
    """Make `cls` (a `Rule` subclass with a `name`) available as `SoupConfig(aggregator=cls.name)`; returns it,
    so it can decorate the class. A name already taken is refused: a rule is never replaced behind a config."""
    if not (isinstance(cls, type) and issubclass(cls, Rule)):
        raise TypeError(f"register_rule takes a subclass of zoo_gym.aggregation.Rule, got {cls!r}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise TypeError(f"{cls.__name__} needs a class attribute `name` (a non-empty str) to be registered")
    if name in _RULES:
        raise ValueError(f"an aggregation rule named {name!r} is already registered ({_RULES[name].__name__}); "
                         "give the new rule another `name`")
    _RULES[name] = cls
    return cls


for _builtin in (Mean, Median, TrimmedMean, Krum, MultiKrum, Bulyan, GeometricMedian, CenteredClip, TrustMean):
    register_rule(_builtin)


def create_rule(config: Any) -> Rule:
    """The rule `config.aggregator` names, with its settings from the config's (a `SoupConfig`'s) flat fields."""
    try:
        cls = _RULES[config.aggregator]
    except KeyError:
        raise SoupConfigError(f"`aggregator` must be one of {', '.join(_RULES)}; got "
                              f"{config.aggregator!r}") from None
    return cls.from_config(config)
