"""Distances: accurate on small deltas (Flower's float32 Gram formula is not) and next to huge
outliers (any Gram formula is not), diagonal exactly 0, and the compressed-domain computation
equals decoding to float to float tolerance, huge scales included."""

from __future__ import annotations

import dataclasses

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


def test_outliers_leave_the_honest_distances_exact():
    # one row at 1e12, one at -1e30: every pair, honest ones included, equals the direct float64
    # reference; the old centred Gram formula lost the honest pairs entirely (off by ~90x at 1e12)
    g = torch.Generator().manual_seed(4)
    x = torch.randn(6, 5000, generator=g)
    x[4] *= 1e12
    x[5] = -1e30 * torch.rand(5000, generator=g)
    ref = _reference(x)
    got = pairwise_sq_distances(x)
    off = ~torch.eye(6, dtype=torch.bool)
    assert float(((got - ref).abs() / ref)[off].max()) < 1e-12
    assert torch.equal(got, got.T) and got.diagonal().tolist() == [0.0] * 6


def test_packed_distances_exact_with_huge_scales():
    # c (sx - sy)^2 + 4 k sx sy has no cancellation: exact next to scales of 1e30 and 1e33
    g = torch.Generator().manual_seed(9)
    models = [[make_packed(torch.randn(4, 96, generator=g) * s, group_size=32)]
              for s in (1.0, 1.5, 1e30, -1e33)]
    ref = _decoded_reference(models)
    got = packed_model_sq_distances(models)
    off = ~torch.eye(4, dtype=torch.bool)
    assert float(((got - ref).abs() / ref)[off].max()) < 1e-12
    scale = torch.tensor([1.0, 0.5, 1e-31, 1.0], dtype=torch.float64)  # clip factors folded in
    dense = torch.stack([m[0].to_dense().reshape(-1) for m in models]).double() * scale[:, None]
    got = packed_model_sq_distances(models, scale=scale)
    ref = _reference(dense)
    assert float(((got - ref).abs() / ref)[off].max()) < 1e-12


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


# ---- whole-model packed distances (several tensors, mixed layouts, one pass) --------------------
from zoo_gym.aggregation.distances import model_sq_distances, packed_model_sq_distances  # noqa: E402
from zoo_gym.aggregation.packed_model import PackedModel  # noqa: E402


def _decoded_reference(models) -> torch.Tensor:
    """float64 pairwise squared distances of the decoded, concatenated tensors."""
    dense = torch.stack([torch.cat([p.to_dense().reshape(-1) for p in m]) for m in models])
    return _reference(dense)


def test_whole_model_hand_computed():
    # contributor 0: +1,+1 / -2 ; contributor 1: +1,-1 / +2 (one group per row, scales 1 and 2)
    a = [make_packed(torch.tensor([[1.0, 1.0]]), group_size=None), make_packed(torch.tensor([[-2.0]]), group_size=None)]
    b = [make_packed(torch.tensor([[1.0, -1.0]]), group_size=None), make_packed(torch.tensor([[2.0]]), group_size=None)]
    d = packed_model_sq_distances([a, b])
    assert d.tolist() == [[0.0, 4.0 + 16.0], [20.0, 0.0]]  # (1-(-1))^2 + (-2-2)^2


@settings(max_examples=30, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 4), st.integers(1, 90)), min_size=1, max_size=5),
       groups=st.lists(st.sampled_from([None, -1, 8, 16, 24, 64, 128]), min_size=5, max_size=5),
       n=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
def test_whole_model_equals_decoded_reference(shapes, groups, n, seed):
    g = torch.Generator().manual_seed(seed)
    models = [[make_packed(torch.randn(r, c, generator=g) * (1 + i), group_size=groups[t])
               for t, (r, c) in enumerate(shapes)] for i in range(n)]
    ref = _decoded_reference(models)
    got = packed_model_sq_distances(models)
    assert got.diagonal().tolist() == [0.0] * n
    assert torch.allclose(got, got.T, rtol=0, atol=0)
    assert torch.allclose(got, ref, rtol=1e-12, atol=1e-15)
    scale = torch.rand(n, generator=g, dtype=torch.float64)
    dense = torch.stack([torch.cat([p.to_dense().reshape(-1) for p in m]) for m in models]).double()
    assert torch.allclose(packed_model_sq_distances(models, scale=scale),
                          _reference(dense * scale[:, None]), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("group", [None, 8, 32, 128, 4096])
def test_word_layouts_chunked_equal_reference(group):
    # wide rows span several chunks; short last groups force padding; all word layouts exercised
    g = torch.Generator().manual_seed(7)
    models = [[make_packed(torch.randn(3, 70_001, generator=g), group_size=group),
               make_packed(torch.randn(1, 129, generator=g), group_size=group)] for _ in range(4)]
    pm = PackedModel.build(models)
    assert pm.words.shape[0] == 4 and pm.counts.sum() == 3 * 70_001 + 129
    got = torch.from_numpy(model_sq_distances(pm))
    assert torch.allclose(got, _decoded_reference(models), rtol=1e-12, atol=0)
    threaded = torch.from_numpy(model_sq_distances(pm, threads=3))  # chunks shared by 3 threads
    assert torch.allclose(threaded, got, rtol=1e-13, atol=0)


def test_identical_contributors_are_exactly_zero_and_scaled_copies_exact():
    g = torch.Generator().manual_seed(3)
    p = [make_packed(torch.randn(5, 300, generator=g), group_size=16)]
    q = [make_packed(torch.randn(5, 300, generator=g), group_size=16)]
    d = packed_model_sq_distances([p, p, q])
    assert d[0, 1] == 0.0 and d[0, 2] > 0
    # same signs, scales x (1 + 1e-9): the scale term cancels in a Gram formula; must stay exact
    d2 = packed_model_sq_distances([p, p], scale=torch.tensor([1.0, 1.0 + 1e-9], dtype=torch.float64))
    exact = float(_decoded_reference([p, p])[0, 0]) + float((p[0].to_dense().double() ** 2).sum()) * 1e-18
    assert float(d2[0, 1]) == pytest.approx(exact, rel=1e-6)


def test_whole_model_refuses_ragged_and_mismatched():
    a = make_packed(torch.randn(2, 16), group_size=8)
    b = make_packed(torch.randn(2, 16), group_size=None)
    with pytest.raises(InvalidDeltaError, match="same tensors in the same order"):
        packed_model_sq_distances([[a, a], [a]])
    with pytest.raises(InvalidDeltaError, match="identical layouts"):
        packed_model_sq_distances([[a, a], [a, b]])
    with pytest.raises(InvalidDeltaError, match="one entry per contributor"):
        packed_model_sq_distances([[a], [a]], scale=torch.ones(3))


def _variants(p):
    """The same delta as tensors `gather` cannot read in place: a strided signs view, float64
    and float16-exact scales, a single scale row broadcast by the caller."""
    strided = torch.zeros((p.rows, 2 * p.signs.shape[1]), dtype=torch.uint8)
    strided[:, ::2] = p.signs
    return [
        dataclasses.replace(p, signs=strided[:, ::2]),                     # not contiguous
        dataclasses.replace(p, scales=p.scales.double()),                  # float64 scales
        dataclasses.replace(p, scales=p.scales.t().contiguous().t()),      # column-major scales
    ]


def test_build_reads_any_cpu_tensor_layout_like_the_checked_fast_path():
    g = torch.Generator().manual_seed(11)
    models = [[make_packed(torch.randn(4, 300, generator=g), group_size=64),
               make_packed(torch.randn(1, 32, generator=g), group_size=None),  # padded group
               make_packed(torch.randn(3, 20, generator=g), group_size=8)] for _ in range(4)]
    assert all(p.checked_layout is not None for m in models for p in m)
    clean = PackedModel.build(models)
    for v in range(3):
        odd = [list(m) for m in models]
        odd[2] = [_variants(p)[v] for p in odd[2]]  # one contributor's tensors, all odd
        assert any(p.checked_layout is None for p in odd[2])
        got = PackedModel.build(odd)
        assert np.array_equal(got.words, clean.words)
        np.testing.assert_array_equal(got.scales, clean.scales)
        assert torch.equal(packed_model_sq_distances(odd), packed_model_sq_distances(models))
    # contributor 0 odd too: everyone takes the tensor-by-tensor path, same result
    first_odd = [[_variants(p)[1] for p in m] for m in models]
    np.testing.assert_array_equal(PackedModel.build(first_odd).scales, clean.scales)


def test_build_names_the_contributor_and_tensor_whose_layout_differs():
    a = make_packed(torch.randn(2, 16), group_size=8)
    b = make_packed(torch.randn(2, 24), group_size=8)
    with pytest.raises(InvalidDeltaError, match="contributor 2 tensor 1 has layout"):
        PackedModel.build([[a, a], [a, a], [a, b]])
    bad = dataclasses.replace(a, signs=a.signs.to(torch.int16))
    with pytest.raises(InvalidDeltaError, match=r"`models\[1\]\[0\].signs` must be uint8"):
        PackedModel.build([[a], [bad]])


def test_dense_kernel_matches_differences_and_threads_do_not_matter():
    # the compiled path (float32 and float64 rows, 1 or 2 threads, rows beyond a multiple of 4) equals
    # the float64 difference reference to float64 rounding, and a NaN row is still named
    g = torch.Generator().manual_seed(7)
    for dtype in (torch.float32, torch.float64):
        x = (torch.randn(7, 10_001, generator=g) * torch.logspace(-6, 6, 7)[:, None]).to(dtype)
        ref = _reference(x)
        off = ~torch.eye(7, dtype=torch.bool)
        for threads in (1, 2):
            got = pairwise_sq_distances(x, threads=threads)
            assert float(((got - ref).abs() / ref)[off].max()) < 1e-12
            assert torch.equal(got, got.T) and got.diagonal().tolist() == [0.0] * 7
    x = torch.randn(4, 3000, generator=g)
    x[2, 17] = float("nan")
    with pytest.raises(InvalidDeltaError, match=r"rows \[2\]"):
        pairwise_sq_distances(x)


def test_combine_kernel_is_bit_identical_to_the_float64_row_loop():
    # the compiled weighted row sum gives combine64's (torch, row by row in float64) very numbers
    from zoo_gym.aggregation._checks import combine, combine64

    g = torch.Generator().manual_seed(8)
    x = torch.randn(6, 5003, generator=g) * torch.logspace(-3, 3, 6)[:, None]
    for w in (torch.ones(6), torch.rand(6, generator=g), torch.tensor([0.0, 1.0, 0.0, 2.0, 3.0, 1e-9])):
        assert torch.equal(combine(w, x), combine64(w, x).to(x.dtype))
        assert torch.equal(combine(w, x[:, 3:4000]), combine64(w, x[:, 3:4000]).to(x.dtype))  # strided rows
        assert torch.equal(combine(w, x.double(), total=7.0), combine64(w, x.double(), total=7.0))
