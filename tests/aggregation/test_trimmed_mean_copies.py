"""The trimmed mean, the median, the geometric median and centered clipping count copies once, as Krum does:
colluders who send one crafted row (sign flip, scaling, ALIE) are one row however many identities send it.
In async mode a buffer of 10 from a federation with 30% attackers rarely holds 5 of them (2 of 287 flushes
over 40 clock-only seeds of benchmarks/async.py), but seed 6 had one: 5 sign-flip copies, past the 4 that
beta = 0.4 trims, and the run ended at 2.23x its clean loss. Counted once they are 1 of 6 rows, trimmed."""

from __future__ import annotations

import math

import torch

from zoo_gym.aggregation import DeltaSoup, SoupConfig
from benchmarks.attacks import scaling, sign_flip
from zoo_gym.aggregation.sources import DictDeltaSource
from zoo_gym.aggregation.trimmed_mean import trimmed_mean


def _honest(seed: int, n: int = 5, d: int = 400) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(d, generator=g) + torch.randn(n, d, generator=g) * 0.5


def _merge(rule: str, x: torch.Tensor, **cfg) -> tuple[torch.Tensor, list[float]]:
    ids = [f"c{i}" for i in range(x.shape[0])]
    out: dict[str, torch.Tensor] = {}
    report = DeltaSoup(SoupConfig(aggregator=rule, max_norm_ratio=None, **cfg)).run(
        DictDeltaSource(ids, [{"w": row.reshape(20, 20).clone()} for row in x]), out.__setitem__)
    return out["w"].reshape(-1), [c.weight for c in report.contributors]


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.double(), b.double(), dim=0))


def test_five_copies_of_a_crafted_row_in_a_buffer_of_ten_are_trimmed() -> None:
    for seed in range(4):
        h = _honest(seed)
        mean = h.mean(0)
        for bad in (sign_flip(h, n_byzantine=5, scale=4.0), scaling(h, n_byzantine=5, boost=10.0)):
            x = torch.cat([h, bad])
            for rule, cfg in (("trimmed-mean", {"trim_beta": 0.4}), ("median", {})):
                agg, weights = _merge(rule, x, **cfg)
                # before: 5 of 10 rows were the attackers', trimming 4 per side kept one of them
                # (sign flip: cos(agg, honest mean) < 0; scaling: |agg| ~ 5 |mean|)
                assert _cos(agg, mean) > 0.9, (seed, rule)
                assert float(agg.norm()) < 1.5 * float(mean.norm()), (seed, rule)
                assert sum(weights[5:]) <= 1 / 6 + 1e-9, (seed, rule)
                assert math.isclose(sum(weights), 1.0, rel_tol=1e-9)


def test_honest_rows_are_never_grouped_and_the_trimmed_mean_is_unchanged() -> None:
    h = _honest(11, n=9)
    agg, _ = _merge("trimmed-mean", h, trim_beta=0.2)
    uniform = torch.full((9,), 1 / 9, dtype=torch.float64)  # the soup's weights without reputations
    assert torch.equal(agg, trimmed_mean(h, beta=0.2, weights=uniform).aggregate)


def test_copies_share_one_rows_weight_in_the_weighted_trimmed_mean() -> None:
    h = _honest(3, n=6)
    x = torch.cat([h, h[:1].repeat(3, 1)])  # an honest row sent by four identities
    w = torch.tensor([1.0, 1, 1, 1, 1, 1, 1, 1, 1], dtype=torch.float64)
    groups = torch.tensor([0, 1, 2, 3, 4, 5, 0, 0, 0])
    res = trimmed_mean(x, beta=0.2, weights=w, groups=groups)
    once = trimmed_mean(h, beta=0.2, weights=w[:6])
    assert torch.allclose(res.aggregate, once.aggregate)
    used = res.diagnostics.weight_used
    assert torch.allclose(used[[0, 6, 7, 8]], once.diagnostics.weight_used[0].expand(4) / 4)
    assert math.isclose(float(used.sum()), 1.0, rel_tol=1e-9)


def test_the_geometric_median_and_centered_clipping_count_copies_once_too() -> None:
    for seed in range(3):
        h = _honest(seed)
        mean = h.mean(0)
        x = torch.cat([h, sign_flip(h, n_byzantine=5, scale=4.0)])
        for rule, cfg in (("geometric-median", {}), ("centered-clip", {})):
            agg, weights = _merge(rule, x, **cfg)
            # before: five copies held half the weight, the breakdown point of both
            assert _cos(agg, mean) > 0.9, (seed, rule, _cos(agg, mean))
            assert sum(weights[5:]) <= 1 / 6 + 1e-6, (seed, rule, sum(weights[5:]))
