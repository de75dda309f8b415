"""Aggregation rules as objects with a fixed keyword-only interface (see base.py), registered by name
(`register_rule`, read through `RULES`, built by `create_rule(config)`); the tensor maths stays in the
pure functions of the package."""

from .averaging import CenteredClip, GeometricMedian, Mean, TrustMean
from .base import CoordinatewisePlan, LinearPlan, Plan, RoundView, Rule
from .coordinatewise import Median, TrimmedMean
from .registry import RULES, create_rule, register_rule
from .selection import Bulyan, Krum, MultiKrum

__all__ = ["RULES", "Bulyan", "CenteredClip", "CoordinatewisePlan", "GeometricMedian", "Krum",
           "LinearPlan", "Mean", "Median", "MultiKrum", "Plan", "RoundView", "Rule", "TrimmedMean", "TrustMean",
           "create_rule", "register_rule"]
