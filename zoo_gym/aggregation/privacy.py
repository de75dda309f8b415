"""Central differential privacy for DeltaSoup: DP-FedAvg noise and a user-level accountant.

DP-FedAvg (McMahan et al. 2018, arXiv:1710.06963), accounted for the sampled Gaussian mechanism with
Opacus's PRV accountant (Gopi, Lee, Wutschitz 2021, arXiv:2106.02848; an upper bound including its
error) and, as a cross-check, Renyi DP (Mironov, Talwar, Zhang 2019); the reported figure is the smaller
of the two sound bounds (PRV in practice). Each whole delta is clipped to L2 norm <= C, server weights are
ignored, the (trust-weighted) sum of the clipped deltas gets N(0, (z C)^2) per coordinate and is divided by the
FIXED ``dp_expected_contributors`` m. Only rules whose influence bound is proven run with DP (config.DP_AGGREGATORS).
`accounted_step` turns (z, q) into what the accountant charges: participation public (the server's ledger names
the participants) is replace-one at q = 1, i.e. (z / 2, 1); participation private is add/remove at q as sampled.
Per-contributor diagnostics are not private. The threat model and every surface: docs/design/privacy.md.
"""

from __future__ import annotations

import functools
import math
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import numpy as np
from torch import Tensor

from .errors import SoupConfigError

# Opacus RDPAccountant.DEFAULT_ALPHAS, copied so the figures match it exactly.
RDP_ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))


def _check_step(*, noise_multiplier: float, sample_rate: float) -> None:
    if not noise_multiplier > 0 or not math.isfinite(noise_multiplier):
        raise SoupConfigError(f"`dp_noise_multiplier` must be > 0 to account privacy, got "
                              f"{noise_multiplier}")
    if not 0 < sample_rate <= 1:
        raise SoupConfigError(f"sample rate q must be in (0, 1], got {sample_rate} (q = 1 unless the "
                              "caller samples contributors at random: see this module's docstring)")


def rdp_epsilon(history: Iterable[tuple[float, float, int]], *, delta: float) -> float:
    """Epsilon for `delta` after the (noise_multiplier, sample_rate, steps) rows of `history`."""
    rows = list(history)
    if not rows:
        return 0.0
    if not 0 < delta < 1:
        raise SoupConfigError(f"`dp_delta` must be in (0, 1), got {delta}")
    from opacus.accountants.analysis import rdp as rdp_analysis  # here: opacus + scipy are ~110 MB of resident memory

    rdp = sum(rdp_analysis.compute_rdp(q=q, noise_multiplier=z, steps=s, orders=list(RDP_ORDERS))
              for z, q, s in rows)
    eps, _ = rdp_analysis.get_privacy_spent(orders=list(RDP_ORDERS), rdp=rdp, delta=delta)
    return float(eps)


def prv_epsilon(history: Iterable[tuple[float, float, int]], *, delta: float) -> float:
    """Epsilon for `delta` after `history` by Opacus's PRV accountant (its upper bound: the estimate plus
    its error); math.inf when the PRV analysis cannot run on this history (then RDP is the figure)."""
    rows = [(float(z), float(q), int(s)) for z, q, s in history]
    if not rows:
        return 0.0
    from opacus.accountants import PRVAccountant  # here: opacus + scipy are ~110 MB of resident memory

    acct = PRVAccountant()
    acct.history = rows
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore", RuntimeWarning)  # log(0) at q = 1, masked by Opacus's np.where
            eps = float(acct.get_epsilon(delta=delta))
    except (ValueError, RuntimeError, ArithmeticError):
        return math.inf
    return eps if math.isfinite(eps) and eps >= 0 else math.inf


def epsilon(history: Iterable[tuple[float, float, int]], *, delta: float) -> float:
    """The reported epsilon: the smaller of the PRV and RDP bounds (both sound; PRV is the tighter)."""
    return _epsilon(tuple((float(z), float(q), int(s)) for z, q, s in history), float(delta))


@functools.lru_cache(maxsize=256)
def _epsilon(rows: tuple[tuple[float, float, int], ...], delta: float) -> float:
    """`epsilon` for a hashable history: PRV's numerical analysis takes ~0.1 s, and a round asks for the same
    histories again (before, after, this round alone)."""
    if not rows:
        return 0.0
    return min(prv_epsilon(rows, delta=delta), rdp_epsilon(rows, delta=delta))


class PrivacyAccountant:
    """History of (noise_multiplier, sample_rate, steps) rows plus pure accounting maths (PRV, RDP).

    The server persists `history` with each round and in the checkpoint manifest, and rebuilds
    the accountant from it: `PrivacyAccountant(history=rows)`.
    """

    def __init__(self, history: Iterable[tuple[float, float, int]] = ()) -> None:
        self.history: list[tuple[float, float, int]] = [
            (float(z), float(q), int(s)) for z, q, s in history]

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """Record one round (merged into the last row when (z, q) are unchanged, like Opacus)."""
        _check_step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)
        if self.history and self.history[-1][:2] == (noise_multiplier, sample_rate):
            z, q, s = self.history[-1]
            self.history[-1] = (z, q, s + 1)
        else:
            self.history.append((float(noise_multiplier), float(sample_rate), 1))

    def epsilon(self, *, delta: float) -> float:
        """Epsilon spent so far for `delta` (the reported figure: PRV, or RDP should it be smaller)."""
        return epsilon(self.history, delta=delta)

    def epsilon_rdp(self, *, delta: float) -> float:
        """The RDP figure for the same history: the cross-check (never below the reported one)."""
        return rdp_epsilon(self.history, delta=delta)

    def epsilon_if_step(self, *, noise_multiplier: float, sample_rate: float,
                        delta: float) -> float:
        """Epsilon after one more round with (z, q), without recording it."""
        trial = PrivacyAccountant(self.history)  # merged exactly as `step` would merge it
        trial.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)
        return trial.epsilon(delta=delta)


@dataclass(frozen=True)
class PrivacyReport:
    """What one round spent: per-round and cumulative epsilon at `delta` (PRV), and the RDP cross-check."""

    epsilon_round: float
    epsilon_total: float
    delta: float
    q: float
    noise_multiplier: float
    clip: float
    expected_contributors: int
    mechanism: str                     # the rule and the fixed denominator that ran
    participation: str                 # "public" (replace-one, q = 1) or "private" (add/remove, q as sampled)
    accounted_noise_multiplier: float  # z over the adjacency's sensitivity in units of C/m (z / 2 when public)
    epsilon_total_rdp: float | None = None  # RDP's figure for the same history (>= epsilon_total)


def accounted_step(noise_multiplier: float, sample_rate: float, *, participation: str) -> tuple[float, float]:
    """(z, q) as the accountant must charge one release of the fixed-denominator mean with noise std z C / m.

    private: only the noised aggregate is released, so neighbours differ by adding or removing one person
    (sensitivity C / m) and sampling that nobody can observe amplifies (q as sampled).
    public: who took part is known (the ledger names whom each round paid), so what is protected is the content
    of a contribution: neighbours replace one person's delta (sensitivity 2 C / m, i.e. z / 2 in units of it),
    and no sampling is hidden (q = 1). Every published round is charged to everyone: the largest of the
    per-contributor figures, and an upper bound on each."""
    if participation == "private":
        return float(noise_multiplier), float(sample_rate)
    if participation == "public":
        return float(noise_multiplier) / 2.0, 1.0
    raise SoupConfigError(f"`dp_participation` must be public or private, got {participation!r}")


def secure_generator() -> torch.Generator:
    """A fresh CPU generator seeded with 64 bits from os.urandom (unpredictable to others)."""
    g = torch.Generator()
    g.manual_seed(int.from_bytes(os.urandom(8), "little"))
    return g


def gaussian_noise(shape: tuple[int, ...], *, std: float, generator: torch.Generator,
                   secure: bool = False, dtype: torch.dtype = torch.float32) -> Tensor:
    """N(0, std^2) noise of `shape`; `secure` sums 4 draws / 2 (same std; Opacus's mitigation of
    floating-point attacks on the Gaussian mechanism, Mironov 2012)."""
    if std == 0.0:
        return torch.zeros(shape, dtype=dtype)
    if secure:
        total = torch.zeros(shape, dtype=torch.float64)
        for _ in range(4):
            total += torch.normal(0.0, std, size=shape, generator=generator, dtype=torch.float64)
        return (total / 2).to(dtype)
    return torch.normal(0.0, std, size=shape, generator=generator, dtype=dtype)
