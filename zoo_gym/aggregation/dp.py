"""Differential privacy as a step around any rule: clip each whole delta, check the budget before
anything is published, noise the rule's output, then adapt the clip and account the release
(DP-FedAvg, McMahan et al. 2018, arXiv:1710.06963; adaptive clipping, Andrew et al. 2021,
arXiv:1905.03871). Like Flower's `DifferentialPrivacyServerSideFixedClipping(strategy, ...)` it
wraps the rule without changing it. Noise multiplier 0: clipping only (when a clip norm is set).
The mechanism's maths and what its guarantee covers: privacy.py, clipping.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from .clipping import adaptive_clip_update, clip_factors, update_noise_multiplier
from .errors import InvalidDeltaError, PrivacyBudgetExceeded, SoupConfigError
from .privacy import (PrivacyAccountant, PrivacyReport, accounted_step, epsilon, gaussian_noise,
                      secure_generator)
from .rules.base import Rule

if TYPE_CHECKING:
    from .config import SoupConfig


@dataclass(frozen=True)
class Weighting:
    """The round's weights as the mechanism allows them (fields of `rules.RoundView`)."""

    weights: Tensor              # (k,) float64 shares
    weighted: bool               # False: uniform by construction
    denominator: float | None    # the mean's fixed denominator
    factored: bool               # the mean may skip the decoded rows


class DifferentialPrivacy:
    """Clip -> rule -> noise -> account; holds the (adaptive) clip norm between rounds. Its settings are the
    config's dp_* fields, read under their names there (the flags'): `dp_noise_multiplier` is z from the flag to
    the noise, where it becomes `z_update` (z less the adaptive clip's share) and then the noise's std."""

    def __init__(self, rule: Rule, config: SoupConfig, *, clip: float | None = None) -> None:
        self.rule, self.config = rule, config
        self.clip = config.dp_clip if clip is None else clip  # the clip norm now: dp_clip, or as adapted since

    @property
    def enabled(self) -> bool:
        return self.config.dp_noise_multiplier > 0

    def clip_factors(self, norms: Tensor) -> Tensor:
        """(k,) float64 factors min(1, C / norm) over each whole delta; ones without a clip norm."""
        if self.clip is None:
            return torch.ones(norms.numel(), dtype=torch.float64)
        return clip_factors(norms, max_norm=self.clip)

    def open(self, *, submitted: int, population: int | None,
             accountant: PrivacyAccountant | None, sample_rate: float | None = None) -> Release:
        """This round's release; raises PrivacyBudgetExceeded before anything is published. `sample_rate`:
        the probability with which the caller sampled each person (overrides m / population)."""
        cfg = self.config
        if not self.enabled:
            m_exp = cfg.dp_expected_contributors or submitted
            return Release(self, expected=m_exp, count_stddev=cfg.dp_clip_count_stddev or m_exp / 20.0,
                           z_update=0.0, privacy=None)
        m_exp = self._fixed_denominator()
        count_std = cfg.dp_clip_count_stddev or m_exp / 20.0
        z_update = cfg.dp_noise_multiplier  # on the sum: z, less the share the adaptive clip's count takes
        if cfg.dp_adaptive_clip:
            z_update = update_noise_multiplier(noise_multiplier=cfg.dp_noise_multiplier, count_stddev=count_std)
        delta = cfg.dp_delta
        q = min(1.0, m_exp / population) if population else 1.0
        q = float(sample_rate) if sample_rate is not None else q
        z_acct, q_acct = accounted_step(cfg.dp_noise_multiplier, q, participation=cfg.dp_participation)
        acct = accountant if accountant is not None else PrivacyAccountant()
        eps_before = acct.epsilon(delta=delta)
        eps_after = acct.epsilon_if_step(noise_multiplier=z_acct, sample_rate=q_acct, delta=delta)
        if cfg.dp_target_epsilon is not None and eps_after > cfg.dp_target_epsilon:
            raise PrivacyBudgetExceeded(epsilon_spent=eps_before, epsilon_if_published=eps_after,
                                        target=cfg.dp_target_epsilon, delta=delta)
        trial = PrivacyAccountant(acct.history)
        trial.step(noise_multiplier=z_acct, sample_rate=q_acct)
        privacy = PrivacyReport(
            epsilon_round=epsilon([(z_acct, q_acct, 1)], delta=delta), epsilon_total=eps_after, delta=delta,
            q=q_acct, noise_multiplier=cfg.dp_noise_multiplier, clip=float(self.clip), expected_contributors=m_exp,
            mechanism=f"{self.rule.name} / fixed m={m_exp}", participation=cfg.dp_participation,
            accounted_noise_multiplier=z_acct, epsilon_total_rdp=trial.epsilon_rdp(delta=delta))
        return Release(self, expected=m_exp, count_stddev=count_std, z_update=z_update, privacy=privacy)

    def _fixed_denominator(self) -> int:
        """m, fixed before any submission; refuses a rule whose influence bound the noise does not match
        (SoupConfig refuses both first: this guards callers that build the step by hand)."""
        if not self.rule.dp_exact:
            raise SoupConfigError(f"DP noise is calibrated to the fixed-denominator mean's bound C/m; rule "
                                  f"{self.rule.name!r} has no such bound: refused")
        if self.config.dp_expected_contributors is None:
            raise SoupConfigError("DP needs a fixed denominator `dp_expected_contributors`, set before any "
                                  "submission: refused")
        return int(self.config.dp_expected_contributors)


class Release:
    """One round through the mechanism: its weighting, its noise, and closing it."""

    def __init__(self, dp: DifferentialPrivacy, *, expected: int, count_stddev: float, z_update: float,
                 privacy: PrivacyReport | None) -> None:
        self.dp, self.expected, self.count_stddev, self.privacy = dp, expected, count_stddev, privacy
        self.clip = dp.clip
        # per-coordinate std on the published average: (z C) on the sum over m expected contributors
        self.noise_std = z_update * self.clip / expected if dp.enabled else 0.0
        self.generator: torch.Generator | None = None

    def weighting(self, k: int, server: Callable[[], Tensor]) -> Weighting:
        """Inside the mechanism every contribution weighs the same and the mean divides by m;
        otherwise the server's weights (`server()`, called only then)."""
        if self.dp.enabled:
            return Weighting(torch.full((k,), 1.0 / k, dtype=torch.float64), weighted=False,
                             denominator=float(self.expected), factored=False)
        return Weighting(server(), weighted=True, denominator=None, factored=True)

    def start(self, generator: torch.Generator | None) -> None:
        """Take the noise's randomness before the first tensor is published."""
        self.generator = secure_generator() if self.dp.config.dp_secure_noise else generator
        if self.dp.enabled and self.generator is None:
            raise InvalidDeltaError("DP noise needs randomness: pass `generator=` or set dp_secure_noise")

    def noise(self, agg: Tensor) -> Tensor:
        """The rule's aggregate of one tensor plus N(0, noise_std^2) per coordinate under DP."""
        if not self.dp.enabled:
            return agg
        return agg + self.draw(tuple(agg.shape), dtype=agg.dtype)

    def draw(self, shape: tuple[int, ...], *, dtype: torch.dtype) -> Tensor:
        """The next tensor's noise alone, from the round's one stream: what `noise` adds (the Ray engine draws it
        here, tensor after tensor as the local pass does, and its tasks add their blocks of it)."""
        return gaussian_noise(shape, std=self.noise_std, generator=self.generator,
                              secure=self.dp.config.dp_secure_noise, dtype=dtype)

    def close(self, norms: Tensor, *, accountant: PrivacyAccountant | None) -> float | None:
        """After publishing: the next round's clip norm (adapted from the accepted `norms` (k,)
        before clipping) and the release accounted. Returns that clip norm."""
        dp, cfg = self.dp, self.dp.config
        if dp.enabled and cfg.dp_adaptive_clip:
            dp.clip = adaptive_clip_update(norms, clip=self.clip, target_quantile=cfg.dp_target_quantile,
                                           lr=cfg.dp_clip_lr, count_stddev=self.count_stddev,
                                           expected_contributors=self.expected,
                                           generator=self.generator, secure=cfg.dp_secure_noise)
        if dp.enabled and accountant is not None:
            accountant.step(noise_multiplier=self.privacy.accounted_noise_multiplier, sample_rate=self.privacy.q)
        return dp.clip if dp.enabled and cfg.dp_adaptive_clip else self.clip
