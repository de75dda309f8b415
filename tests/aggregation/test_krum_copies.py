"""Krum and Multi-Krum count copies once: colluders who send one crafted row (ALIE) are each other's
nearest neighbours at distance 0, which used to make Multi-Krum choose all of them; honest deltas are
never merged."""

from __future__ import annotations

import math

import torch

from zoo_gym.aggregation import DeltaSoup, SoupConfig, multi_krum
from benchmarks.attacks import alie, alie_z
from zoo_gym.aggregation.krum import duplicate_groups
from zoo_gym.aggregation.distances import pairwise_sq_distances
from zoo_gym.aggregation.sources import DictDeltaSource


def _buffer(seed: int, honest: int = 7, colluders: int = 3, d: int = 400) -> torch.Tensor:
    """Honest deltas around a common direction, then ALIE's one row sent by every colluder."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(d, generator=g)
    h = c + torch.randn(honest, d, generator=g) * 0.5
    bad = alie(h, n_byzantine=colluders, z=alie_z(n=honest + colluders, n_byzantine=colluders))
    return torch.cat([h, bad])


def test_copies_of_an_alie_row_weigh_one_row_in_multi_krum() -> None:
    for seed in range(5):
        x = _buffer(seed)
        res = multi_krum(x, f=3, m=5)
        colluders_share = float(res.diagnostics.weight_used[7:].sum())
        # before: the three copies scored best (two zero distances each) and took 3 of the 5 rows
        assert colluders_share <= 1 / 5 + 1e-12, (seed, colluders_share)
        assert int(res.diagnostics.selected[:7].sum()) >= 4  # the rest of the average is honest


def test_honest_deltas_are_never_grouped_and_multi_krum_is_unchanged_for_them() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(9, 300, generator=g) / math.sqrt(300) + torch.randn(300, generator=g)
    assert duplicate_groups(pairwise_sq_distances(x)).tolist() == list(range(9))
    res = multi_krum(x, f=2, m=5)
    assert int(res.diagnostics.selected.sum()) == 5
    assert torch.allclose(res.diagnostics.weight_used[res.diagnostics.selected],
                          torch.full((5,), 0.2, dtype=torch.float64))


def test_the_streamed_pipeline_gives_copies_one_rows_weight() -> None:
    x = _buffer(7)
    ids = [f"c{i}" for i in range(x.shape[0])]
    deltas = [{"w": row.reshape(20, 20).clone()} for row in x]
    out: dict[str, torch.Tensor] = {}
    report = DeltaSoup(SoupConfig(aggregator="multi-krum", byzantine_f=3, multi_krum_m=5, max_norm_ratio=None)).run(
        DictDeltaSource(ids, deltas), out.__setitem__)
    weights = [c.weight for c in report.contributors]
    assert sum(weights[7:]) <= 1 / 5 + 1e-9
    assert math.isclose(sum(weights), 1.0, rel_tol=1e-9)
    expected = sum(w * row for w, row in zip(weights, x.double()))
    assert torch.allclose(out["w"].reshape(-1).double(), expected, atol=1e-5)
