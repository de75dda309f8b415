"""Whole-delta L2 clipping and adaptive clipping (Andrew, Thakkar, McMahan, Ramaswamy 2021,
"Differentially Private Learning with Adaptive Clipping", NeurIPS; arXiv:1905.03871).

clip factor_i = min(1, C / ||x_i||) over ALL tensors of contribution i; a zero delta gets
factor 1 (Flower divides by its unguarded norm). Adaptive clipping moves C towards the
`target_quantile` of the norms: C <- C * exp(-lr (b - gamma)), b the noised share of
contributions with norm <= C, from the centred count sum_i (1[norm_i <= C] - 1/2) (sensitivity 1/2; noise
std `count_stddev` on it, divided by m, plus 1/2); the update
noise multiplier becomes (z^-2 - (2 sigma_b)^-2)^(-1/2) so the round's total stays z (Andrew et
al., Theorem 1), with sigma_b = count_stddev.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .errors import SoupConfigError
from .privacy import gaussian_noise


def clip_factors(norms: Tensor, *, max_norm: float) -> Tensor:
    """(n,) float64 factors min(1, C / norm); 1 where norm is 0."""
    if not max_norm > 0:
        raise SoupConfigError(f"`dp_clip` must be > 0, got {max_norm}")
    norms = norms.to(torch.float64)
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    return torch.where(norms > max_norm, max_norm / safe, torch.ones_like(norms))


def update_noise_multiplier(*, noise_multiplier: float, count_stddev: float) -> float:
    """Noise multiplier left for the update when the clipped count takes std `count_stddev`."""
    rest = noise_multiplier ** -2 - (2.0 * count_stddev) ** -2
    if rest <= 0:
        raise SoupConfigError(
            f"`dp_clip_count_stddev`={count_stddev} is too small for `dp_noise_multiplier`="
            f"{noise_multiplier}: need count_stddev > z/2 = {noise_multiplier / 2}")
    return rest ** -0.5


def adaptive_clip_update(norms: Tensor, *, clip: float, target_quantile: float, lr: float,
                         count_stddev: float, expected_contributors: int,
                         generator: torch.Generator, secure: bool = False) -> float:
    """Next round's clip norm from this round's norms (geometric update)."""
    if not 0 < target_quantile < 1:
        raise SoupConfigError(f"`dp_target_quantile` must be in (0, 1), got {target_quantile}")
    # the centred count sum_i (1[norm_i <= C] - 1/2): one person moves it by 1/2, the sensitivity that
    # `update_noise_multiplier`'s budget assumes (Andrew et al. 2021, sec. 3); the uncentred count moves by 1
    centred = float((norms.to(torch.float64) <= clip).sum()) - norms.numel() / 2.0
    noise = float(gaussian_noise((1,), std=count_stddev, generator=generator, secure=secure,
                                 dtype=torch.float64)[0])
    b = (centred + noise) / expected_contributors + 0.5
    return clip * math.exp(-lr * (b - target_quantile))
