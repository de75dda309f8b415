"""`SoupConfig`: the flat, operator-facing settings of the DeltaSoup pipeline.

Each field is one setting: field `byzantine_f` <-> config key `byzantine-f` or `byzantine_f` <->
CLI flag `--byzantine-f` <-> the field of the rule that uses it (rules/: `MultiKrum.byzantine_f`), which
checks it; every check names its field. `aggregator` names the rule (rules/registry.py), built once into
`SoupConfig.rule`; the dp_* fields configure the DP step (dp.py).
Why the defaults are what they are: docs/design/aggregation.md.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .errors import SoupConfigError
if TYPE_CHECKING:
    from .rules import Rule

# AGGREGATORS (the rules' names) and DP_AGGREGATORS (those whose per-contributor influence bound is proven, so DP
# noise can be calibrated to it: `dp_exact`) are read from the registry, rules/registry.py, on access (module
# __getattr__ below): reading a config imports no torch, the registry does. Every other rule is refused with DP on.
PARTICIPATION = ("public", "private")
DEFAULT_AGGREGATOR = "trimmed-mean"  # the one declaration of the default rule (SoupConfig's, a Round row's)


@dataclass
class SoupConfig:
    """Settings of validate -> clip -> robust aggregate -> noise. Every check names its field."""

    aggregator: str = dataclasses.field(default=DEFAULT_AGGREGATOR, metadata={"help": "one of mean, median, trimmed-mean, krum, multi-krum, bulyan, geometric-median, centered-clip, trust-mean (default " + DEFAULT_AGGREGATOR + ": robust, needs >= 3 contributors; mean is not robust; with DP only mean or trust-mean, the mean weighted by each delta's agreement with the operator's validation gradient)"})
    byzantine_f: int = dataclasses.field(default=0, metadata={"help": "Byzantine contributors tolerated (krum, multi-krum, bulyan)"})
    multi_krum_m: int | None = dataclasses.field(default=None, metadata={"help": "contributors Multi-Krum averages (default n - f; K // 2 per buffer in async mode)"})
    trim_beta: float = dataclasses.field(default=0.4, metadata={"help": "share trimmed from each end per coordinate, [0, 0.5) (default 0.4: near the median, which 1-bit deltas need against sign flips; docs/design/aggregation.md)"})
    trust_ramp: float = dataclasses.field(default=0.0, metadata={"help": "trust-mean: a delta whose cosine with the operator's descent direction reaches this counts fully, below it in proportion, at or below 0 not at all (0: any positive cosine counts fully)"})
    cc_tau: float = dataclasses.field(default=1.0, metadata={"help": "centered-clipping radius (whole-delta L2)"})
    cc_iters: int = dataclasses.field(default=3, metadata={"help": "centered-clipping iterations"})
    gm_eps: float = dataclasses.field(default=1e-8, metadata={"help": "geometric median: stop once the iterate moves less than this x the median distance to it"})
    gm_max_iter: int = dataclasses.field(default=32, metadata={"help": "geometric median: Weiszfeld steps at most (one pass over the model each)"})
    gm_nu: float = dataclasses.field(default=1e-6, metadata={"help": "geometric median: smoothing (distance floor)"})
    max_delta_norm: float | None = dataclasses.field(default=None, metadata={"help": "validation: refuse deltas with larger whole-delta L2 norm"})
    max_norm_ratio: float | None = dataclasses.field(default=10.0, metadata={"help": "validation: refuse a delta whose whole-delta L2 norm exceeds this x the (lower) median norm of the round's finite, non-zero deltas; None disables (ignored under DP)"})
    max_weight_share: float | None = dataclasses.field(default=None, metadata={"help": "cap on any one contributor's weight share (without DP)"})
    min_contributors: int = dataclasses.field(default=1, metadata={"help": "refuse the round with fewer accepted contributions"})
    dp_noise_multiplier: float = dataclasses.field(default=0.0, metadata={"help": "z: noise std on the sum is z * dp_clip; 0 = no DP"})
    dp_clip: float | None = dataclasses.field(default=None, metadata={"help": "C: whole-delta L2 clip norm (initial value when adaptive)"})
    dp_adaptive_clip: bool = dataclasses.field(default=False, metadata={"help": "adapt C to a norm quantile (Andrew et al. 2021)"})
    dp_target_quantile: float = dataclasses.field(default=0.5, metadata={"help": "adaptive clipping: target share of unclipped norms"})
    dp_clip_lr: float = dataclasses.field(default=0.2, metadata={"help": "adaptive clipping: geometric learning rate"})
    dp_clip_count_stddev: float | None = dataclasses.field(default=None, metadata={"help": "adaptive clipping: noise std on the unclipped count (default m/20)"})
    dp_expected_contributors: int | None = dataclasses.field(default=None, metadata={"help": "m: the mean's fixed denominator under DP, set before any submission (required with DP: dividing by the number who submitted moves the release by up to 2C/n and reveals the cohort's size)"})
    dp_participation: str = dataclasses.field(default="public", metadata={"help": "public: who took part in a round is known (the ledger names whom it paid), so the epsilon protects the content of a contribution (replace-one adjacency, sensitivity 2C/m, no amplification by sampling); private: nothing but the noised aggregate is released (add/remove adjacency, sampling amplifies). docs/design/privacy.md"})
    dp_delta: float = dataclasses.field(default=1e-5, metadata={"help": "delta of the (epsilon, delta) guarantee"})
    dp_target_epsilon: float | None = dataclasses.field(default=None, metadata={"help": "stop publishing before epsilon would exceed this"})
    dp_secure_noise: bool = dataclasses.field(default=False, metadata={"help": "draw noise from an os.urandom-seeded generator (ignore the given one)"})

    def __post_init__(self) -> None:
        self._rule = self._build_rule()
        for name in ("max_delta_norm", "dp_clip", "dp_target_epsilon", "dp_clip_count_stddev"):
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise SoupConfigError(f"`{name}` must be > 0 (or unset), got {value}")
        if self.max_norm_ratio is not None and not (self.max_norm_ratio >= 1
                                                     and math.isfinite(self.max_norm_ratio)):
            raise SoupConfigError(f"`max_norm_ratio` must be >= 1 (or unset), got "
                                  f"{self.max_norm_ratio}: below 1 it would refuse the median delta")
        if self.max_weight_share is not None and not 0 < self.max_weight_share <= 1:
            raise SoupConfigError(f"`max_weight_share` must be in (0, 1], got {self.max_weight_share}")
        if self.min_contributors < 1:
            raise SoupConfigError(f"`min_contributors` must be >= 1, got {self.min_contributors}")
        if not (self.dp_noise_multiplier >= 0 and math.isfinite(self.dp_noise_multiplier)):
            raise SoupConfigError(f"`dp_noise_multiplier` must be >= 0, got {self.dp_noise_multiplier}")
        if self.dp_participation not in PARTICIPATION:
            raise SoupConfigError(f"`dp_participation` must be public or private, got {self.dp_participation!r}")
        if self.dp_noise_multiplier > 0:
            self._check_dp_bound()
        if self.dp_noise_multiplier > 0 and self.dp_clip is None:
            raise SoupConfigError("`dp_clip` is required when `dp_noise_multiplier` > 0: the noise "
                                  "is calibrated to the clip norm (set --dp-clip)")
        if self.dp_adaptive_clip and self.dp_clip is None:
            raise SoupConfigError("`dp_adaptive_clip` needs an initial `dp_clip`")
        if not 0 < self.dp_target_quantile < 1:
            raise SoupConfigError(f"`dp_target_quantile` must be in (0, 1), got {self.dp_target_quantile}")
        if not self.dp_clip_lr > 0:
            raise SoupConfigError(f"`dp_clip_lr` must be > 0, got {self.dp_clip_lr}")
        if self.dp_expected_contributors is not None and self.dp_expected_contributors < 1:
            raise SoupConfigError(f"`dp_expected_contributors` must be >= 1, got "
                                  f"{self.dp_expected_contributors}")
        if not 0 < self.dp_delta < 1:
            raise SoupConfigError(f"`dp_delta` must be in (0, 1), got {self.dp_delta}")
        if self.dp_target_epsilon is not None and self.dp_noise_multiplier == 0:
            raise SoupConfigError("`dp_target_epsilon` is set but `dp_noise_multiplier` is 0: "
                                  "without noise there is no privacy to budget")

    def _build_rule(self) -> Rule:
        """The rule `aggregator` names, built once, its settings copied from the fields of the same names. Every
        registered rule's settings are checked, each by its rule (the one check): a bad `trim_beta` is refused
        whatever the aggregator, as it was when SoupConfig checked them itself."""
        from .errors import AggregationError
        from .rules import RULES, create_rule

        if self.aggregator not in RULES:
            raise SoupConfigError(f"`aggregator` must be one of {', '.join(RULES)}; got {self.aggregator!r}")
        try:
            for name, cls in RULES.items():
                if name != self.aggregator and _settable(cls, self):
                    cls.from_config(self)
            return create_rule(self)
        except AggregationError as exc:
            raise SoupConfigError(str(exc)) from None

    def _check_dp_bound(self) -> None:
        """With DP on, only a mechanism whose per-contributor influence bound is proven may run: the noise is
        calibrated to that bound, and for any other rule the epsilon reported would not bound anything."""
        from .rules import RULES

        if not self.rule.dp_exact:
            exact = " or ".join(name for name, cls in RULES.items() if cls.dp_exact)
            raise SoupConfigError(
                f"with DP on (`dp_noise_multiplier` > 0) `aggregator` must be {exact} (the robust "
                "one), got "
                f"{self.aggregator!r}: one added contributor can move its output by many times C/m (trimmed mean "
                "4.8x, Krum 200x), so no epsilon reported for it would be a bound (docs/design/privacy.md)")
        if self.dp_expected_contributors is None:
            raise SoupConfigError(
                "`dp_expected_contributors` (m) is required with DP on: the noised sum is divided by this fixed m, "
                "set before any submission is seen (e.g. the contributors you expect per round)")

    @property
    def dp_enabled(self) -> bool:
        return self.dp_noise_multiplier > 0

    @property
    def rule(self) -> Rule:
        """The rule `aggregator` names, with its settings from these fields (built once, by __post_init__: not a
        field, so not in eq, repr or asdict; dataclasses.replace builds the new config's own)."""
        return self._rule

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> SoupConfig:
        """Build from a config-file mapping; keys may use '-' or '_'; unknown keys are refused."""
        known = {f.name for f in dataclasses.fields(cls)}
        values: dict[str, Any] = {}
        for key, value in mapping.items():
            name = str(key).replace("-", "_")
            if name.startswith("__"):
                name = name[2:]
            if name not in known:
                raise SoupConfigError(f"unknown aggregation config key {key!r}; known keys: "
                                      + ", ".join(sorted(k.replace('_', '-') for k in known)))
            values[name] = value
        return cls(**values)


def _settable(cls: type, config: SoupConfig) -> bool:
    """Whether every setting `cls` declares is one of the config's fields (so the config can check them)."""
    names = cls.settings()
    return bool(names) and all(hasattr(config, name) for name in names)


def __getattr__(name: str) -> tuple[str, ...]:
    """AGGREGATORS and DP_AGGREGATORS, from the registry as it is now (PEP 562: importing this module imports no
    torch, the registry does)."""
    if name not in ("AGGREGATORS", "DP_AGGREGATORS"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from .rules import RULES

    return tuple(rule for rule, cls in RULES.items() if name == "AGGREGATORS" or cls.dp_exact)
