"""Central differential privacy for DeltaSoup: DP-FedAvg noise and a user-level RDP accountant.

Mechanism (DP-FedAvg, McMahan et al. 2018, "Learning Differentially Private Recurrent Language
Models", arXiv:1710.06963; accounting by Renyi DP, Mironov 2017, and the sampled Gaussian
mechanism, Mironov, Talwar, Zhang 2019, arXiv:1908.10530, as implemented by Opacus):

* Each contribution's WHOLE delta (every tensor together) is scaled to L2 norm <= C (`clipping.py`;
  a zero delta has factor 1, no division by zero).
* Inside the mechanism every contribution has the same weight: server weights are ignored.
* The mean is sum_i clip(x_i) / m with a FIXED denominator m = `dp_expected_contributors` (not
  the number who showed up), and N(0, (z C)^2) per coordinate is added to the SUM, i.e.
  N(0, (z C / m)^2) to the published average.
* One round = one step of the Gaussian mechanism with noise multiplier z, accounted with
  sampling rate q = 1: NO amplification by subsampling. Contributors choose to submit; the
  gym-server does not sample them at random, so the premise of amplification (each person takes
  part independently with probability q, decided by randomness nobody can predict or steer) does
  not hold, and q = m / registered contributors would let free registrations shrink epsilon
  (z = 1, 10 rounds, delta = 1e-5: 19.05 whatever the number registered; the old q = 5 / 1005
  said 0.85). Epsilon for a target delta is recomputed from the history rows (z, q, steps) with
  Opacus's RDP analysis (`compute_rdp` + `get_privacy_spent`, Opacus's default orders), exactly
  what `opacus.accountants.RDPAccountant` returns for the same history.
* `DeltaSoup.run(population=N)` accounts q = m / N instead. That is valid only for a caller that
  itself samples each of N people independently with probability q, with randomness they can
  neither predict nor influence, from a population Sybils cannot inflate. The gym-server never
  passes it. (The Flower adapter passes the nodes Flower sampled from: Flower draws a fixed-size
  sample without replacement, for which this Poisson figure is an approximation.)

What the guarantee covers: user-level (epsilon, delta)-DP of the sequence of PUBLISHED aggregates
with respect to adding or removing one contributor's entire participation in a round, and across
rounds for the same person as long as one person = one contributor id (Sybil identities are
separate "users" to the accountant: q = 1 means registering more of them lowers nobody's epsilon).
It assumes: (1) nothing about who takes part: with q = 1 every published round is charged to
every contributor as if they had submitted to it, so one who submits whenever they like is
covered. (2) The noise is drawn from a generator the adversary cannot predict (`dp_secure_noise`:
a fresh generator seeded from os.urandom, plus Opacus's sum-of-4-Gaussians smoothing against
floating-point attacks; a caller-supplied seeded generator is for tests and gives no privacy,
unless its seed is secret: the gym-server seeds it with HMAC-SHA256(its private key, base sha256),
so a redo after a crash draws the same noise and nobody without the key can reproduce it).
(3) Nothing other than the noised aggregate is released: per-contributor diagnostics (norms,
scores, selection) in the SoupReport are NOT private and must stay on the server.
(4) Adaptive clipping spends privacy on the noised clipped-count too; following Andrew et al. 2021
the update noise multiplier is reduced so the TOTAL stays z (see `clipping.py`).

Asynchronous rounds (`gym-server serve --mode async`, zoo_gym/server/rounds/async_rounds.py): each buffer
flush is ONE release of this mechanism, accounted exactly like a synchronous round (one step, q = 1),
and the accountant composes the flushes; the budget check runs before each one. The buffer's rows are
staleness-weighted, w(s) = (1 + s)^-a <= 1, BEFORE clipping, so a weighted delta is never longer than
the one submitted and one contributor still moves the noised sum by at most C; server_lr x the noised
aggregate is post-processing. One contributor holds at most one delta per buffer; a contributor whose
deltas enter many flushes is charged by every one of them (as every published round is charged to
everyone), so staleness neither hides a delta from the accountant nor spends less for it.

Composition with robust aggregators: the sensitivity argument (one user moves the noised SUM by
at most C) holds exactly for the mean with fixed denominator (`aggregator="mean"`). For other
rules the same noise N(0, (zC/m)^2) is added to their output, but their output can move by more
than C/m when one user is added or removed: coordinate-wise median and trimmed mean of clipped
deltas move each coordinate to a neighbouring order statistic (up to 2C per coordinate in the
worst case), Krum/Multi-Krum/Bulyan can switch the selection (up to 2C / (number averaged)),
the geometric median and centered clipping are bounded only by their breakdown analysis. So for
those rules the reported epsilon is the DP-FedAvg figure for the same noise, NOT a proven bound;
`SoupReport.privacy.covers_aggregator` is False for them. Clipping before the robust rule still
bounds every contribution's norm, which is what robust rules' own guarantees rely on.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from opacus.accountants.analysis import rdp as rdp_analysis
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
    rdp = sum(rdp_analysis.compute_rdp(q=q, noise_multiplier=z, steps=s, orders=list(RDP_ORDERS))
              for z, q, s in rows)
    eps, _ = rdp_analysis.get_privacy_spent(orders=list(RDP_ORDERS), rdp=rdp, delta=delta)
    return float(eps)


class PrivacyAccountant:
    """History of (noise_multiplier, sample_rate, steps) rows plus pure RDP maths.

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
        """Epsilon spent so far for `delta`."""
        return rdp_epsilon(self.history, delta=delta)

    def epsilon_if_step(self, *, noise_multiplier: float, sample_rate: float,
                        delta: float) -> float:
        """Epsilon after one more round with (z, q), without recording it."""
        trial = PrivacyAccountant(self.history)  # merged exactly as `step` would merge it
        trial.step(noise_multiplier=noise_multiplier, sample_rate=sample_rate)
        return trial.epsilon(delta=delta)


@dataclass(frozen=True)
class PrivacyReport:
    """What one round spent: per-round and cumulative epsilon at `delta`."""

    epsilon_round: float
    epsilon_total: float
    delta: float
    q: float
    noise_multiplier: float
    clip: float
    expected_contributors: int
    covers_aggregator: bool  # True only for the mean: see the module docstring


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
