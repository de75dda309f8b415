"""Rules as objects: the registry names each once, and each rule says what it needs."""

from __future__ import annotations

import dataclasses

import pytest

from zoo_gym.aggregation.config import DP_AGGREGATORS
from zoo_gym.aggregation import (AGGREGATORS, RULES, Bulyan, CenteredClip, GeometricMedian, Krum, Mean,
                                 Median, MultiKrum, SoupConfig, TrimmedMean, create_rule)
from zoo_gym.aggregation.errors import AggregationError, NotRobustConfigError, SoupConfigError
from zoo_gym.aggregation.rules import TrustMean


def test_registry_builds_each_rule_with_its_own_settings():
    cfg = SoupConfig(aggregator="multi-krum", byzantine_f=2, multi_krum_m=4, trim_beta=0.2, cc_tau=0.5,
                     cc_iters=5, gm_eps=1e-6, gm_max_iter=9, gm_nu=1e-5)
    built = {name: create_rule(dataclasses.replace(cfg, aggregator=name)) for name in AGGREGATORS}
    assert tuple(RULES) == AGGREGATORS
    assert built == {"mean": Mean(), "median": Median(), "trimmed-mean": TrimmedMean(trim_beta=0.2),
                     "krum": Krum(byzantine_f=2), "multi-krum": MultiKrum(byzantine_f=2, multi_krum_m=4),
                     "bulyan": Bulyan(byzantine_f=2),
                     "geometric-median": GeometricMedian(gm_eps=1e-6, gm_max_iter=9, gm_nu=1e-5),
                     "centered-clip": CenteredClip(cc_tau=0.5, cc_iters=5), "trust-mean": TrustMean()}
    assert all(rule.name == name for name, rule in built.items())
    assert cfg.rule == MultiKrum(byzantine_f=2, multi_krum_m=4) and Krum(byzantine_f=1).multi_krum_m == 1


def test_each_setting_has_one_name_from_the_config_to_the_rule():
    # a rule's settings are SoupConfig fields of the same names (so the flag's), with the same defaults
    fields = {f.name: f for f in dataclasses.fields(SoupConfig)}
    for cls in RULES.values():
        for f in dataclasses.fields(cls):
            if f.init:
                assert f.name in fields, f"{cls.__name__}.{f.name} is no SoupConfig field"
                if f.default is not dataclasses.MISSING:
                    assert f.default == fields[f.name].default, f"{cls.__name__}.{f.name}"


def test_the_config_builds_its_rule_once():
    cfg = SoupConfig(aggregator="multi-krum", byzantine_f=1)
    assert cfg.rule is cfg.rule and cfg.rule == MultiKrum(byzantine_f=1)
    other = dataclasses.replace(cfg, multi_krum_m=3)
    assert other.rule == MultiKrum(byzantine_f=1, multi_krum_m=3) and cfg.rule.multi_krum_m is None
    assert "rule" not in dataclasses.asdict(cfg) and "_rule" not in repr(cfg)
    assert cfg == SoupConfig(aggregator="multi-krum", byzantine_f=1)
    # every rule's settings are still checked, by the rule, whatever the aggregator; the message names the field
    with pytest.raises(SoupConfigError, match=r"`trim_beta` must be in \[0, 0.5\), got 0.5"):
        SoupConfig(aggregator="mean", trim_beta=0.5)
    with pytest.raises(SoupConfigError, match="`byzantine_f` must be an integer >= 0"):
        SoupConfig(aggregator="mean", byzantine_f=-1)
    with pytest.raises(SoupConfigError, match="`cc_tau` must be > 0"):
        SoupConfig(cc_tau=0.0)


def test_settings_are_keyword_only_and_checked():
    with pytest.raises(TypeError):
        TrimmedMean(0.1)  # type: ignore[misc]
    with pytest.raises(AggregationError, match="beta"):
        TrimmedMean(trim_beta=0.5)
    with pytest.raises(AggregationError, match="`byzantine_f`"):
        Bulyan(byzantine_f=-1)


@pytest.mark.parametrize("rule", [Mean(), Median(), TrimmedMean(trim_beta=0.0), TrimmedMean(trim_beta=0.1),
                                  TrimmedMean(trim_beta=0.45), Krum(byzantine_f=0), Krum(byzantine_f=2),
                                  MultiKrum(byzantine_f=3, multi_krum_m=2),
                                  Bulyan(byzantine_f=1), GeometricMedian(), CenteredClip()])
def test_minimum_n_is_the_fewest_check_n_accepts(rule):
    accepted = [n for n in range(0, 40) if _accepts(rule, n)]
    assert accepted[0] == rule.minimum_n()
    assert accepted == list(range(rule.minimum_n(), 40))


def _accepts(rule, n: int) -> bool:
    try:
        rule.check_n(n)
    except ValueError:
        return False
    return True


def test_check_n_says_why():
    with pytest.raises(NotRobustConfigError, match=r"multi-krum with f=2 needs n >= 2f \+ 3 = 7"):
        MultiKrum(byzantine_f=2).check_n(6)
    with pytest.raises(NotRobustConfigError, match=r"Bulyan with f=1 needs n >= 4f \+ 3 = 7"):
        Bulyan(byzantine_f=1).check_n(6)
    with pytest.raises(NotRobustConfigError, match="needs at least 3 contributors"):
        TrimmedMean(trim_beta=0.1).check_n(2)
    with pytest.raises(NotRobustConfigError, match="nothing to aggregate"):
        Mean().check_n(0)


def test_what_each_rule_needs():
    needs = {name: (cls.needs_distances, cls.counts_copies_once, cls.iterated, cls.staleness_as_weights,
                    cls.dp_exact) for name, cls in RULES.items()}
    assert needs == {"mean": (False, False, False, True, True),
                     "median": (True, True, False, False, False),
                     "trimmed-mean": (True, True, False, False, False),
                     "krum": (True, False, False, False, False),
                     "multi-krum": (True, False, False, False, False),
                     "bulyan": (True, False, False, False, False),
                     "geometric-median": (True, True, True, False, False),
                     "centered-clip": (True, True, True, False, False),
                     "trust-mean": (False, False, False, False, True)}
    # the rules a DP config may name are exactly those with a proven influence bound (config.DP_AGGREGATORS,
    # spelled out so that reading a config imports no torch)
    assert DP_AGGREGATORS == tuple(name for name, cls in RULES.items() if cls.dp_exact)


@pytest.fixture
def registered():
    """Rules a test registers, taken out of the registry again after it (the registry is process-wide)."""
    from zoo_gym.aggregation.rules import registry

    added: list[str] = []
    yield added
    for name in added:
        registry._RULES.pop(name, None)


def test_a_registered_rule_is_a_config_name_and_aggregates_a_round(registered):
    import torch

    from zoo_gym.aggregation import DeltaSoup, register_rule
    from zoo_gym.aggregation.rules import LinearPlan
    from zoo_gym.aggregation.sources import DictDeltaSource

    @register_rule
    @dataclasses.dataclass(frozen=True, kw_only=True)
    class FirstOnly(Mean):
        """The first accepted row alone (a test rule)."""

        name = "first-only"

        def plan(self, view):
            coeff = torch.zeros(view.k, dtype=torch.float64)
            coeff[0] = 1.0
            return LinearPlan(coeff, selected=coeff > 0)

    registered.append("first-only")
    assert RULES["first-only"] is FirstOnly and "first-only" in tuple(RULES)
    cfg = SoupConfig(aggregator="first-only")
    assert cfg.rule == FirstOnly()
    deltas = [{"w": torch.full((3,), float(i + 1))} for i in range(3)]
    out = {}
    report = DeltaSoup(cfg).run(DictDeltaSource(["a", "b", "c"], deltas), out.__setitem__)
    assert report.aggregator == "first-only" and out["w"].tolist() == [1.0, 1.0, 1.0]
    assert [r.selected for r in report.contributors] == [True, False, False]


def test_registering_a_taken_name_or_a_non_rule_is_refused(registered):
    from zoo_gym.aggregation import register_rule

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class AnotherMean(Mean):
        name = "mean"

    with pytest.raises(ValueError, match="'mean' is already registered"):
        register_rule(AnotherMean)
    assert RULES["mean"] is Mean
    with pytest.raises(TypeError, match="subclass of zoo_gym.aggregation.Rule"):
        register_rule(dict)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        RULES["x"] = Mean  # type: ignore[index]  # the view is read-only


def test_the_aggregator_help_names_the_built_in_rules_in_registry_order():
    # spelled out in config.py so that `gym-server --help` imports no torch; the registry is the declaration
    builtin = [name for name, cls in RULES.items() if cls.__module__.startswith("zoo_gym.aggregation.rules.")]
    help_text = {f.name: f for f in dataclasses.fields(SoupConfig)}["aggregator"].metadata["help"]
    assert help_text.startswith("one of " + ", ".join(builtin) + " (default")
