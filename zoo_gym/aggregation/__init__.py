"""Robust, private aggregation of contributors' deltas (pure tensor functions, no I/O).

Aggregators take a stacked (n, d) tensor and return an `AggregateResult` (aggregate + per-
contributor diagnostics). `DeltaSoup` chains validate -> clip -> group copies -> rule -> noise over
a streamed `DeltaSource`; rules are objects named once (`create_rule`, `SoupConfig.rule`) and DP is
a step around any of them (`DifferentialPrivacy`). The Flower adapter lives in `zoo_gym.aggregation.flower` (imports flwr).
"""

from .bulyan import bulyan, bulyan_select
from .centered_clip import centered_clip
from .clipping import clip_factors
from .config import AGGREGATORS, SoupConfig
from .dp import DifferentialPrivacy
from .distances import (model_sq_distances, packed_model_sq_distances, packed_pairwise_sq_distances,
                        packed_sq_norms, pairwise_sq_distances)
from .errors import (AggregationError, InvalidDeltaError, NotRobustConfigError,
                     PrivacyBudgetExceeded, SoupConfigError)
from .geometric_median import geometric_median
from .krum import krum, krum_scores, krum_select, multi_krum, multi_krum_select
from .mean import mean
from .packed_mean import model_mean, packed_mean
from .packed_model import PackedModel
from .median import median
from .privacy import PrivacyAccountant, PrivacyReport
from .result import AggregateResult, Diagnostics
from .rules import (RULES, Bulyan, CenteredClip, GeometricMedian, Krum, Mean, Median, MultiKrum, Rule,
                    TrimmedMean, create_rule)
from .soup import ContributorReport, DeltaSoup, DeltaSource, SoupReport
from .trimmed_mean import trimmed_mean

__all__ = [
    "AGGREGATORS", "RULES", "AggregateResult", "AggregationError", "Bulyan", "CenteredClip",
    "ContributorReport", "DeltaSoup", "DeltaSource", "Diagnostics", "DifferentialPrivacy",
    "GeometricMedian", "InvalidDeltaError", "Krum", "Mean", "Median", "MultiKrum", "NotRobustConfigError",
    "Rule", "TrimmedMean", "create_rule",
    "PackedModel", "PrivacyAccountant", "PrivacyBudgetExceeded", "PrivacyReport", "SoupConfig",
    "SoupConfigError", "SoupReport", "bulyan", "bulyan_select", "centered_clip", "clip_factors",
    "geometric_median", "krum", "krum_scores", "krum_select", "mean", "median", "model_mean",
    "model_sq_distances", "multi_krum", "multi_krum_select", "packed_mean",
    "packed_model_sq_distances", "packed_pairwise_sq_distances", "packed_sq_norms",
    "pairwise_sq_distances", "trimmed_mean",
]
