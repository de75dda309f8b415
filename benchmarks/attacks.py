"""Byzantine deltas made from honest ones (model poisoning; label flipping is data poisoning and
lives with the training data). Each function takes the honest stack (n_honest, d), keyword-only
parameters and a `torch.Generator`, and returns (n_byzantine, d); inputs are never mutated.

- sign_flip: -scale * honest mean (Damaskinos et al. 2018 style reversed gradient).
- scaling: model replacement, boost * honest mean (Bagdasaryan et al. 2020, arXiv:1807.00459).
- gaussian: N(mean, sigma^2) or pure N(0, sigma^2) deltas (Blanchard et al. 2017).
- alie: "A Little Is Enough", mean - z * std per coordinate (Baruch et al. 2019, arXiv:1902.06156);
  z defaults to the paper's z_max from n and the number of attackers.
- ipm: inner-product manipulation, -epsilon * honest mean (Xie, Koyejo, Gupta 2020,
  arXiv:1903.03936).
- free_rider_zero / free_rider_random: contribute nothing, or noise with the honest norm scale.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import torch
from torch import Tensor

from zoo_gym.aggregation import AggregationError
from zoo_gym.aggregation._checks import check_deltas


def _count(n_byzantine: int) -> int:
    if n_byzantine < 1:
        raise AggregationError(f"`n_byzantine` must be >= 1, got {n_byzantine}")
    return n_byzantine


def sign_flip(honest: Tensor, *, n_byzantine: int, scale: float = 1.0,
              generator: torch.Generator | None = None) -> Tensor:
    """(n_byzantine, d): -scale * honest mean."""
    honest = check_deltas(honest, name="honest")
    return (-scale * honest.mean(dim=0)).expand(_count(n_byzantine), -1).clone()


def scaling(honest: Tensor, *, n_byzantine: int, boost: float = 10.0,
            generator: torch.Generator | None = None) -> Tensor:
    """(n_byzantine, d): boost * honest mean (model replacement)."""
    honest = check_deltas(honest, name="honest")
    return (boost * honest.mean(dim=0)).expand(_count(n_byzantine), -1).clone()


def gaussian(honest: Tensor, *, n_byzantine: int, sigma: float, around_mean: bool = False,
             generator: torch.Generator) -> Tensor:
    """(n_byzantine, d): N(0, sigma^2) (or around the honest mean) per coordinate."""
    honest = check_deltas(honest, name="honest")
    noise = torch.randn((_count(n_byzantine), honest.shape[1]), generator=generator,
                        dtype=honest.dtype) * sigma
    return noise + honest.mean(dim=0) if around_mean else noise


def alie_z(*, n: int, n_byzantine: int) -> float:
    """Baruch et al.'s z_max: s = floor(n/2 + 1) - f; z = Phi^-1((n - s) / n)."""
    s = math.floor(n / 2 + 1) - n_byzantine
    p = (n - s) / n
    if not 0 < p < 1:
        raise AggregationError(f"ALIE z undefined for n={n}, n_byzantine={n_byzantine}; pass z=")
    return NormalDist().inv_cdf(p)


def alie(honest: Tensor, *, n_byzantine: int, z: float | None = None,
         generator: torch.Generator | None = None) -> Tensor:
    """(n_byzantine, d): mean - z * std per coordinate (all attackers send the same)."""
    honest = check_deltas(honest, name="honest")
    n = honest.shape[0] + _count(n_byzantine)
    zz = alie_z(n=n, n_byzantine=n_byzantine) if z is None else z
    std = honest.std(dim=0, unbiased=False) if honest.shape[0] > 1 else torch.zeros_like(honest[0])
    return (honest.mean(dim=0) - zz * std).expand(n_byzantine, -1).clone()


def ipm(honest: Tensor, *, n_byzantine: int, epsilon: float = 0.5,
        generator: torch.Generator | None = None) -> Tensor:
    """(n_byzantine, d): -epsilon * honest mean (small epsilon passes distance filters)."""
    honest = check_deltas(honest, name="honest")
    return (-epsilon * honest.mean(dim=0)).expand(_count(n_byzantine), -1).clone()


def free_rider_zero(honest: Tensor, *, n_byzantine: int,
                    generator: torch.Generator | None = None) -> Tensor:
    """(n_byzantine, d) zeros: claims a contribution, sends nothing."""
    honest = check_deltas(honest, name="honest")
    return torch.zeros((_count(n_byzantine), honest.shape[1]), dtype=honest.dtype)


def free_rider_random(honest: Tensor, *, n_byzantine: int, generator: torch.Generator) -> Tensor:
    """(n_byzantine, d): Gaussian noise scaled to the honest mean's per-coordinate RMS norm."""
    honest = check_deltas(honest, name="honest")
    rms = float(honest.pow(2).mean().sqrt())
    return torch.randn((_count(n_byzantine), honest.shape[1]), generator=generator,
                       dtype=honest.dtype) * rms
