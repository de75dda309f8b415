"""Robust, private aggregation of contributors' deltas (pure tensor functions, no I/O).

Aggregators take a stacked (n, d) tensor and return an `AggregateResult` (aggregate + per-
contributor diagnostics). `DeltaSoup` chains validate -> clip -> group copies -> rule -> noise over
a streamed `DeltaSource`; rules are objects named once (`register_rule`, `SoupConfig.rule`) and DP is
a step around any of them (`DifferentialPrivacy`). The Flower adapter is `zoo_gym.integrations.flower`.
"""

from __future__ import annotations

from zoo_gym.lazy_exports import lazy_exports

# submodule -> the names it defines, imported on first use (zoo_gym/lazy_exports.py): importing the
# package, or a torch-free submodule of it (configs, errors), does not import torch
_LAZY = {
    "bulyan": "bulyan bulyan_select",
    "centered_clip": "centered_clip",
    "clipping": "clip_factors",
    "config": "AGGREGATORS SoupConfig",
    "dp": "DifferentialPrivacy",
    "distances": "model_sq_distances packed_model_sq_distances packed_pairwise_sq_distances packed_sq_norms "
                 "pairwise_sq_distances",
    "errors": "AggregationError InvalidDeltaError NotRobustConfigError PrivacyBudgetExceeded SoupConfigError",
    "geometric_median": "geometric_median",
    "krum": "krum krum_scores krum_select multi_krum multi_krum_select",
    "mean": "mean",
    "packed_mean": "model_mean packed_mean",
    "packed_model": "PackedModel",
    "median": "median",
    "privacy": "PrivacyAccountant PrivacyReport",
    "result": "AggregateResult Diagnostics",
    "rules": "RULES Bulyan CenteredClip GeometricMedian Krum Mean Median MultiKrum Rule TrimmedMean "
             "create_rule register_rule",
    "soup": "ContributorReport DeltaSoup DeltaSource SoupReport",
    "trimmed_mean": "trimmed_mean",
}

__all__ = [
    "AGGREGATORS", "RULES", "AggregateResult", "AggregationError", "Bulyan", "CenteredClip",
    "ContributorReport", "DeltaSoup", "DeltaSource", "Diagnostics", "DifferentialPrivacy",
    "GeometricMedian", "InvalidDeltaError", "Krum", "Mean", "Median", "MultiKrum", "NotRobustConfigError",
    "Rule", "TrimmedMean", "create_rule", "register_rule",
    "PackedModel", "PrivacyAccountant", "PrivacyBudgetExceeded", "PrivacyReport", "SoupConfig",
    "SoupConfigError", "SoupReport", "bulyan", "bulyan_select", "centered_clip", "clip_factors",
    "geometric_median", "krum", "krum_scores", "krum_select", "mean", "median", "model_mean",
    "model_sq_distances", "multi_krum", "multi_krum_select", "packed_mean",
    "packed_model_sq_distances", "packed_pairwise_sq_distances", "packed_sq_norms",
    "pairwise_sq_distances", "trimmed_mean",
]

__getattr__, __dir__ = lazy_exports(__name__, globals(), _LAZY)
