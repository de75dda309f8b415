"""Contribution score of every submission of a round.

``L0`` is the base's held-out loss, ``L_i`` that of base + i's clipped delta alone, ``g_i = (L0 - L_i) /
L0`` the solo gain and ``phi_i`` the marginal effect (``marginal.py``; ``phi_i := g_i`` when there is no
``subset_loss``, and ``method`` says so). ``score_i = sqrt(max(g_i, 0) max(phi_i, 0)) * p_i * c_i``, with
``p_i`` the part of the delta the aggregator used (selected, untrimmed, clip factor ** clip_exponent)
and ``c_i = min(1, median_j(k_j) / k_i) ** krum_exponent`` from the aggregator's score. A submission
refused by validation scores 0, and so does one whose marginal is within ``min_marginal_z`` standard errors of 0
on the scoring examples, when they were measured; scores are always finite and >= 0.
Notation in full and why nobody is paid for nothing: docs/design/rewards-scoring.md.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal, Protocol

from zoo_gym.evaluation.scoring_metrics import SCORING_METRICS  # noqa: F401  (server.config checks --scoring-metric by it)

from .errors import ConfigError, ScoringInputError
from .marginal import CachedValue, MarginalEstimate, SubsetLoss, gtg_shapley, leave_one_out

if TYPE_CHECKING:  # torch is imported where it is used: the configs load without it
    import torch


class DiagnosticsLike(Protocol):
    accepted: bool
    reason: str
    selected: bool
    trimmed_share: float
    clip_factor: float
    krum_score: float


@dataclass(frozen=True)
class ContributionDiagnostics:
    """What the server's validation and the aggregator say about one submission."""

    accepted: bool = True           # passed validation (shape, norm, signature, base hash ...)
    reason: str = ""                # why it was refused, when it was
    selected: bool = True           # entered the aggregate (Krum/Multi-Krum selection)
    trimmed_share: float = 0.0      # share of coordinates trimmed away, in [0, 1]
    clip_factor: float = 1.0        # clipped norm / submitted norm, in (0, 1]
    krum_score: float = math.nan    # aggregator score, lower = more central; nan if none

    def __post_init__(self) -> None:
        if not 0.0 <= self.trimmed_share <= 1.0:
            raise ScoringInputError(f"`trimmed_share` must be in [0, 1], got {self.trimmed_share}")
        if not 0.0 < self.clip_factor <= 1.0:
            raise ScoringInputError(f"`clip_factor` must be in (0, 1], got {self.clip_factor}")


@dataclass(frozen=True)
class ScoringConfig:
    """How contributions are scored; see the module docstring for the formula."""

    marginal: Literal["gtg_shapley", "leave_one_out", "none"] = "gtg_shapley"
    max_evaluations: int = 64       # distinct `subset_loss` calls per round (forward passes)
    max_permutations: int = 16      # GTG-Shapley permutations per round
    truncation_tol: float = 0.01    # within-round truncation, share of |V(N)|
    between_tol: float = 1e-9       # |V(N)| below this: the round gained nothing, phi = 0
    convergence_tol: float = 0.05   # mean relative change of the estimates to stop early
    clip_exponent: float = 0.5      # how much DP clipping lowers the score (0: not at all)
    unselected_factor: float = 0.0  # credit kept by a submission the aggregator left out
    krum_exponent: float = 1.0      # how much being far from the others lowers the score
    seed: int = 0                   # permutation sampling seed when no generator is passed
    min_marginal_z: float = 1.0     # paid only when phi_i > this x its standard error over the scoring examples

    def __post_init__(self) -> None:
        if self.marginal not in ("gtg_shapley", "leave_one_out", "none"):
            raise ConfigError("`marginal` must be 'gtg_shapley', 'leave_one_out' or 'none', "
                              f"got {self.marginal!r}")
        if self.max_evaluations < 0:
            raise ConfigError(f"`max_evaluations` must be >= 0, got {self.max_evaluations}")
        if self.max_permutations < 1:
            raise ConfigError(f"`max_permutations` must be >= 1, got {self.max_permutations}")
        for name in ("truncation_tol", "between_tol", "convergence_tol", "clip_exponent",
                     "krum_exponent", "min_marginal_z"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v >= 0):
                raise ConfigError(f"`{name}` must be finite and >= 0, got {v}")
        if not 0.0 <= self.unselected_factor <= 1.0:
            raise ConfigError(f"`unselected_factor` must be in [0, 1], got "
                              f"{self.unselected_factor}")


@dataclass(frozen=True)
class ContributionScore:
    """One submission's score and the components it was computed from (kept for the ledger)."""

    contributor: str
    score: float          # >= 0; 0 for refused submissions
    accepted: bool        # passed the server's validation
    reason: str           # human-readable: why the score is what it is
    solo_gain: float      # g_i
    marginal: float       # phi_i (nan for refused submissions)
    value: float          # sqrt(max(g,0) * max(phi,0))
    participation: float  # p_i
    consensus: float      # c_i
    method: str           # how phi was computed: gtg_shapley | leave_one_out | solo
    marginal_error: float = math.nan  # phi's standard error over the scoring examples (nan: not measured)


@dataclass(frozen=True)
class RoundScoring:
    """`score_round_detailed`'s answer: the scores plus what the marginal estimate cost."""

    scores: list[ContributionScore]
    estimate: MarginalEstimate


def _consensus(krum: Sequence[float], accepted: Sequence[bool], *, exponent: float) -> list[float]:
    finite = [k for k, a in zip(krum, accepted) if a and math.isfinite(k)]
    if not finite:
        return [1.0] * len(krum)
    med = statistics.median(finite)
    out = []
    for k in krum:
        if not math.isfinite(k) or k <= med or med <= 0:
            out.append(1.0)
        else:
            out.append((med / k) ** exponent)
    return out


def combine_scores(contributors: Sequence[str], gains: Sequence[float],
                   estimate: MarginalEstimate, diagnostics: Sequence[DiagnosticsLike],
                   config: ScoringConfig, *, zero_reasons: dict[int, str] | None = None
                   ) -> list[ContributionScore]:
    """``score_i = sqrt(max(g_i,0) max(phi_i,0)) p_i c_i`` from solo gains, marginals and the
    aggregator's diagnostics (module docstring); shared by exact and first-order scoring.

    ``zero_reasons[i]``, when given, forces submission ``i``'s score to 0 with that reason (a
    check outside this formula failed, e.g. first-order scoring's random-direction gate).
    """
    accepted = [bool(d.accepted) for d in diagnostics]
    zero_reasons = zero_reasons or {}
    consensus = _consensus([float(d.krum_score) for d in diagnostics], accepted,
                           exponent=config.krum_exponent)
    scores = []
    for i, (who, d) in enumerate(zip(contributors, diagnostics)):
        if not accepted[i]:
            scores.append(ContributionScore(
                contributor=who, score=0.0, accepted=False,
                reason=f"refused by validation: {d.reason or 'no reason given'}",
                solo_gain=gains[i], marginal=math.nan, value=0.0, participation=0.0,
                consensus=consensus[i], method=estimate.method))
            continue
        g, phi = gains[i], estimate.values[i]
        se = estimate.errors.get(i, math.nan) if estimate.errors else math.nan
        value_i = math.sqrt(max(g, 0.0) * max(phi, 0.0))
        sel = 1.0 if d.selected else config.unselected_factor
        part = sel * (1.0 - d.trimmed_share) * d.clip_factor ** config.clip_exponent
        score = value_i * part * consensus[i]
        if i in zero_reasons:
            score, reason = 0.0, zero_reasons[i]
        elif not math.isfinite(score):  # never pay an unmeasurable amount
            score, reason = 0.0, f"score not finite (solo gain {g:.3g}, marginal {phi:.3g})"
        elif g <= 0:
            reason = f"held-out loss did not improve (solo gain {g:.3g})"
        elif phi <= 0:
            reason = f"no positive marginal effect on the aggregate ({estimate.method} {phi:.3g})"
        elif not d.selected and config.unselected_factor == 0:
            reason = "not selected by the robust aggregator"
        elif phi <= config.min_marginal_z * se:  # never true when se is nan (not measured)
            score, reason = 0.0, (f"marginal {phi:.3g} ({estimate.method}) is within {config.min_marginal_z:g} x "
                                  f"its standard error ({se:.3g}) of 0 on the scoring examples: not told from chance")
        else:
            reason = (f"solo gain {g:.3g}, marginal {phi:.3g} ({estimate.method}), "
                      f"participation {part:.3g}, consensus {consensus[i]:.3g}")
        scores.append(ContributionScore(
            contributor=who, score=score, accepted=True, reason=reason, solo_gain=g,
            marginal=phi, value=value_i, participation=part, consensus=consensus[i],
            method=estimate.method, marginal_error=se))
    return scores


def score_round_detailed(contributors: Sequence[str], base_loss: float,
                         solo_losses: Sequence[float], diagnostics: Sequence[DiagnosticsLike],
                         subset_loss: SubsetLoss | None, config: ScoringConfig, *,
                         generator: torch.Generator | None = None,
                         base_losses: torch.Tensor | None = None) -> RoundScoring:
    """Like `score_round`, also returning the marginal estimate (method, evaluations spent)."""
    n = len(contributors)
    if len(solo_losses) != n or len(diagnostics) != n:
        raise ScoringInputError(f"`contributors` ({n}), `solo_losses` ({len(solo_losses)}) and "
                                f"`diagnostics` ({len(diagnostics)}) must have the same length")
    if len(set(contributors)) != n:
        raise ScoringInputError("`contributors` holds duplicates; score one submission per "
                                "contributor per round")
    if not (math.isfinite(base_loss) and base_loss > 0):
        raise ScoringInputError(f"`base_loss` must be finite and > 0, got {base_loss!r}")
    accepted = [bool(d.accepted) for d in diagnostics]
    players = [i for i in range(n) if accepted[i]]
    # A non-finite solo loss (the delta broke the model) counts as "loss went up".
    gains = [(base_loss - float(l)) / base_loss if math.isfinite(l) else -math.inf
             for l in solo_losses]

    estimate: MarginalEstimate | None = None
    note = ""
    spent = 0  # evaluations made even when the estimate is abandoned
    if subset_loss is not None and config.marginal != "none" and players:
        value = CachedValue(subset_loss, base_loss=base_loss, max_evaluations=config.max_evaluations,
                            base_losses=base_losses)
        if config.marginal == "leave_one_out":
            estimate = leave_one_out(players, value)
        else:
            import torch

            gen = generator if generator is not None else torch.Generator().manual_seed(config.seed)
            estimate = gtg_shapley(players, value, max_permutations=config.max_permutations,
                                   truncation_tol=config.truncation_tol,
                                   between_tol=config.between_tol,
                                   convergence_tol=config.convergence_tol, generator=gen)
        spent = value.evaluations
        if estimate is None:
            note = (f"max_evaluations={config.max_evaluations} cannot pay one {config.marginal} "
                    f"pass over {len(players)} contributors; used the solo gain")
    elif config.marginal != "none" and players:
        note = "no subset_loss given; used the solo gain"
    if estimate is None:
        estimate = MarginalEstimate(values={i: gains[i] for i in players}, method="solo",
                                    evaluations=spent, note=note)

    scores = combine_scores(contributors, gains, estimate, diagnostics, config)
    return RoundScoring(scores=scores, estimate=estimate)


def score_round(contributors: Sequence[str], base_loss: float, solo_losses: Sequence[float],
                diagnostics: Sequence[DiagnosticsLike], subset_loss: SubsetLoss | None,
                config: ScoringConfig, *, generator: torch.Generator | None = None,
                base_losses: torch.Tensor | None = None) -> list[ContributionScore]:
    """Score every submission of a round (formula in the module docstring).

    ``subset_loss(S)`` must return the held-out loss of base + the aggregate of the submissions
    whose indices are in ``S`` (a subset of the validated ones); it is called at most
    ``config.max_evaluations`` times, never with the empty set (that is ``base_loss``). It may return the
    (examples,) losses of each scoring example instead, with ``base_losses`` the base's: then each marginal's
    standard error is measured and ``config.min_marginal_z`` applies.
    """
    return score_round_detailed(contributors, base_loss, solo_losses, diagnostics, subset_loss,
                                config, generator=generator, base_losses=base_losses).scores
