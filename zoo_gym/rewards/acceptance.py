"""Minimum quality: which scored submissions are paid.

    threshold = min_quality * median_{i validated}(score_i)          (min_quality 0.8 by default)
    paid_i    = validated_i  and  score_i > 0  and  score_i >= threshold

Refused submissions do not count towards the median. When the median is 0 the rule is "score > 0", so
a round where nobody helped pays nobody. The unpaid part of the pool is not minted.
Why: docs/design/rewards-scoring.md.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

from .errors import ConfigError
from .scoring import ContributionScore


def quality_threshold(scores: Sequence[ContributionScore], *, min_quality: float) -> float:
    """``min_quality`` x the median score of the validated submissions (0 if there are none)."""
    if not (math.isfinite(min_quality) and min_quality >= 0):
        raise ConfigError(f"`min_quality` must be finite and >= 0, got {min_quality}")
    valid = [s.score for s in scores if s.accepted]
    return min_quality * statistics.median(valid) if valid else 0.0


def accept_by_quality(scores: Sequence[ContributionScore], *, min_quality: float = 0.8
                      ) -> list[bool]:
    """Whether each submission meets the minimum quality (rule in the module docstring)."""
    t = quality_threshold(scores, min_quality=min_quality)
    return [s.accepted and s.score > 0 and s.score >= t for s in scores]
