"""Distances: accurate on small deltas (Flower's float32 Gram formula is not), diagonal exactly 0,
and the compressed-domain computation equals decoding to float to float tolerance."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st
from helpers import make_packed

from zoo_gym.aggregation import packed_pairwise_sq_distances, packed_sq_norms, pairwise_sq_distances
from zoo_gym.aggregation.errors import InvalidDeltaError


def _reference(x: torch.Tensor) -> torch.Tensor:
    x = x.double()
    return torch.stack([((x[i] - x) ** 2).sum(dim=1) for i in range(x.shape[0])])


def test_hand_computed_distances():
    x = torch.tensor([[0.0, 0.0], [3.0, 4.0], [1.0, 1.0]])
    d = pairwise_sq_distances(x)
    assert d.dtype == torch.float64
    expected = torch.tensor([[0.0, 25.0, 2.0], [25.0, 0.0, 13.0], [2.0, 13.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(d, expected, rtol=1e-14, atol=0)
    assert d.diagonal().tolist() == [0.0, 0.0, 0.0]


def test_small_deltas_on_large_weights_are_accurate_where_float32_gram_is_not():
    g = torch.Generator().manual_seed(0)
    base = torch.randn(200_000, generator=g)                          # shared weights
    deltas = 1e-3 * torch.randn(5, 200_000, generator=g)              # small fine-tune deltas
    weights = base + deltas                                           # what Flower sees
    ref = _reference(deltas)
    off = ~torch.eye(5, dtype=torch.bool)
    ours = pairwise_sq_distances(weights)                             # even on full weights
    assert float(((ours - ref).abs() / ref)[off].max()) < 1e-6
    w = weights.numpy()
    norms = (w * w).sum(axis=1)
    flower = norms[:, None] + norms[None, :] - 2 * w @ w.T            # Flower's formula, float32
    rel = np.abs(flower - ref.numpy())[off.numpy()] / ref.numpy()[off.numpy()]
    assert rel.max() > 0.01                                            # several percent off


def test_duplicates_have_zero_diagonal_and_zero_pair():
    x = torch.ones(3, 10) * 0.1
    d = pairwise_sq_distances(x)
    assert torch.count_nonzero(d) == 0


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 5), cols=st.integers(1, 70), n=st.integers(2, 5),
       group=st.sampled_from([None, -1, 8, 16, 24]), seed=st.integers(0, 2**31 - 1))
def test_packed_distances_equal_decoded(rows, cols, n, group, seed):
    g = torch.Generator().manual_seed(seed)
    packed = [make_packed(torch.randn(rows, cols, generator=g), group_size=group) for _ in range(n)]
    dense = torch.stack([p.to_dense().reshape(-1) for p in packed])
    ref = _reference(dense)
    got = packed_pairwise_sq_distances(packed)
    assert torch.allclose(got, ref, rtol=1e-9, atol=1e-9)
    assert torch.allclose(packed_sq_norms(packed), (dense.double() ** 2).sum(1), rtol=1e-9)
    scale = torch.rand(n, generator=g, dtype=torch.float64)
    got_scaled = packed_pairwise_sq_distances(packed, scale=scale)
    assert torch.allclose(got_scaled, _reference(dense.double() * scale[:, None]), rtol=1e-9, atol=1e-9)


def test_packed_refuses_mixed_layouts():
    a = make_packed(torch.randn(2, 16), group_size=8)
    b = make_packed(torch.randn(2, 16), group_size=None)
    with pytest.raises(InvalidDeltaError, match="identical layouts"):
        packed_pairwise_sq_distances([a, b])
