"""trust-mean against the published attacks, with and without DP (issue 46): the robust rule that DP can run.

Ten contributors, three Byzantine; the honest deltas scatter around a direction u that the operator's reference r
shares only loosely (cosine 0.3), as a validation gradient and real deltas do. The Byzantine deltas follow
benchmarks/attacks.py: boosted sign flip, scaling, ALIE and IPM. The aggregate must stay near the honest mean."""

from __future__ import annotations

import pytest
import torch

from benchmarks import attacks
from zoo_gym.aggregation import DeltaSoup, SoupConfig
from zoo_gym.aggregation.sources import DictDeltaSource

D, HONEST, BYZ = 400, 7, 3


def _round(attack: str, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(D, generator=g)
    u /= u.norm()
    v = torch.randn(D, generator=g)
    v -= (v @ u) * u
    r = 0.3 * u + (1 - 0.09) ** 0.5 * v / v.norm()  # the operator's direction: cosine 0.3 with u
    honest = torch.stack([u + 0.8 * torch.randn(D, generator=g) / D ** 0.5 for _ in range(HONEST)])
    fn = {"sign_flip": lambda h: attacks.sign_flip(h, n_byzantine=BYZ, scale=4.0),
          "scaling": lambda h: attacks.scaling(h, n_byzantine=BYZ, boost=10.0),
          "alie": lambda h: attacks.alie(h, n_byzantine=BYZ, generator=g),
          "ipm": lambda h: attacks.ipm(h, n_byzantine=BYZ, epsilon=0.5)}[attack]
    return honest, torch.cat([honest, fn(honest)]), r


def _aggregate(cfg: SoupConfig, rows: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    out: dict[str, torch.Tensor] = {}
    DeltaSoup(cfg).run(DictDeltaSource([f"c{i}" for i in range(len(rows))], [{"w": x} for x in rows]),
                       out.__setitem__, reference={"w": r}, generator=torch.Generator().manual_seed(1))
    return out["w"].double()


@pytest.mark.parametrize("attack", ["sign_flip", "scaling", "alie", "ipm"])
def test_trust_mean_keeps_the_honest_direction_where_the_mean_loses_it(attack):
    honest, rows, r = _round(attack)
    target = honest.double().mean(0)
    cos = lambda a: float(a @ target / (a.norm() * target.norm()))  # noqa: E731
    trust = _aggregate(SoupConfig(aggregator="trust-mean"), rows, r)
    mean = _aggregate(SoupConfig(aggregator="mean"), rows, r)
    assert cos(trust) > 0.95 and (trust - target).norm() < 0.3 * target.norm()
    if attack in ("sign_flip", "scaling"):  # the plain mean is ruined or dominated
        assert (mean - target).norm() > target.norm()


@pytest.mark.parametrize("attack", ["sign_flip", "scaling", "alie", "ipm"])
def test_under_dp_the_attackers_count_no_more_than_clipped_honest_deltas(attack):
    """Under DP every delta is clipped to C and weighs at most 1 / m: the attack's pull is bounded by f C / m and
    the reversed ones count nothing; the release's direction stays the honest one (noise 1e-9: the mechanism's
    deterministic part)."""
    honest, rows, r = _round(attack)
    c = float(honest.norm(dim=1).median())
    cfg = SoupConfig(aggregator="trust-mean", dp_noise_multiplier=1e-9, dp_clip=c, dp_expected_contributors=10,
                     dp_participation="private")
    out = _aggregate(cfg, rows, r)
    clean = _aggregate(cfg, honest, r)  # the same mechanism without the attackers
    target = honest.double().mean(0)
    assert float(out @ target / (out.norm() * target.norm())) > 0.9
    assert (out - clean).norm() <= BYZ * c / 10 * (1 + 1e-6)
