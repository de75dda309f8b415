"""Copies among many rows from a sketch (issue 51): above EXACT_MAX rows the coordinate-wise rules group copies
from each row's CountSketch instead of k^2 x d exact distances and a (k, k) matrix. The groups, and so the
aggregate and the report, are those of the exact distances on rows with exact copies, near copies (a 0.1% nudge,
the way a Sybil dodges a byte comparison) and honest spread."""

import importlib

import numpy as np
import pytest
import torch

from zoo_gym.aggregation import DeltaSoup, SoupConfig
from zoo_gym.aggregation.distances import pairwise_sq_distances
from zoo_gym.aggregation.krum import duplicate_groups
from zoo_gym.aggregation.sketched_copies import groups_from_sketch, sketch
from zoo_gym.aggregation.sources import DictDeltaSource

soup_module = importlib.import_module("zoo_gym.aggregation.soup")
SHAPES = {"a.weight": (64, 100), "b.weight": (1000,)}


def _rows(k: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    rows = {n: torch.randn(k, int(np.prod(s)), generator=g) for n, s in SHAPES.items()}
    for r in rows.values():
        r[10:40] = r[0]  # 30 exact copies of row 0
        nudge = torch.randn(5, r.shape[1], generator=g) * 1e-3 * float(r[1].norm()) / r.shape[1] ** 0.5
        r[40:45] = r[1] + nudge  # 5 near copies of row 1
        r[50:53] = r[2]  # and a small group
    return rows


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sketch_groups_are_the_exact_groups(seed):
    k = 400
    rows = _rows(k, seed)
    exact = duplicate_groups(sum(pairwise_sq_distances(r) for r in rows.values()))
    sketched = groups_from_sketch(sketch(((n, lambda n=n: rows[n]) for n in rows), k))
    assert np.array_equal(sketched, exact)
    assert (exact != np.arange(k)).sum() == 30 + 5 + 3


def test_the_trimmed_mean_of_many_rows_is_the_exact_one(monkeypatch):
    k = 300
    rows = _rows(k, 7)
    ids = [f"c{i}" for i in range(k)]
    deltas = [{n: rows[n][i].reshape(SHAPES[n]) for n in rows} for i in range(k)]

    def run():
        got = {}
        report = DeltaSoup(SoupConfig(aggregator="trimmed-mean")).run(
            DictDeltaSource(ids, deltas), lambda name, agg: got.__setitem__(name, agg.clone()))
        return got, report

    sketched, rep_s = run()
    monkeypatch.setattr(soup_module, "EXACT_MAX", k)  # every row through the exact distances
    exact, rep_e = run()
    assert all(torch.equal(sketched[n], exact[n]) for n in SHAPES)
    assert repr(rep_s.contributors) == repr(rep_e.contributors)  # score is nan for both (nan != nan)
