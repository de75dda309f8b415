"""packed_mean: the weighted mean of packed BitDelta deltas against the decoded reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zoo_gym.aggregation.errors import AggregationError, InvalidDeltaError
from zoo_gym.aggregation.packed_mean import packed_mean
from zoo_gym.codec.bitdelta import BitDeltaPacked

EPS32 = float(np.finfo(np.float32).eps)


def make_packed(rng: np.random.Generator, *, rows: int, cols: int, group_size: int) -> BitDeltaPacked:
    """Random sign bits (padding bits 0) and positive float32 scales in the codec's packed layout."""
    nbytes = -(-cols // 8)
    signs = rng.integers(0, 256, (rows, nbytes), dtype=np.uint8)  # (rows, nbytes)
    if cols % 8:
        signs[:, -1] &= np.uint8((1 << (cols % 8)) - 1)
    n_groups = -(-cols // group_size)
    scales = rng.uniform(1e-4, 1e-2, (rows, n_groups)).astype(np.float32)  # (rows, n_groups)
    return BitDeltaPacked(shape=(rows, cols), rows=rows, cols=cols, group_size=group_size,
                          signs=torch.from_numpy(signs), scales=torch.from_numpy(scales))


def reference64(packed, weights) -> tuple[np.ndarray, np.ndarray]:
    """float64 exact-ish sum_i w_i decode_i, and the per-element bound sum_i |w_i s_i|."""
    w = np.full(len(packed), 1.0 / len(packed)) if weights is None else np.asarray(weights, float)
    w = w / w.sum()
    dense = [p.to_dense().numpy().astype(np.float64) for p in packed]  # each (rows, cols)
    ref = sum(wi * d for wi, d in zip(w, dense))
    mag = sum(wi * np.abs(d) for wi, d in zip(w, dense))
    return ref, mag


def test_hand_computed_two_contributors_cols_not_multiple_of_8():
    # Prepare: 1 row, 3 columns, one scale per row; bits little-endian: 0b101 -> +, -, +
    a = BitDeltaPacked(shape=(3,), rows=1, cols=3, group_size=3,
                       signs=torch.tensor([[0b101]], dtype=torch.uint8), scales=torch.tensor([[2.0]]))
    b = BitDeltaPacked(shape=(3,), rows=1, cols=3, group_size=3,
                       signs=torch.tensor([[0b011]], dtype=torch.uint8), scales=torch.tensor([[1.0]]))
    # Execute
    uniform = packed_mean([a, b])
    weighted = packed_mean([a, b], weights=[3.0, 1.0])
    # Assert: (2*[1,-1,1] + [1,1,-1]) / 2 and (6*[1,-1,1] + [1,1,-1]) / 4
    assert uniform.dtype == torch.float32 and uniform.shape == (1, 3)
    assert uniform.tolist() == [[1.5, -0.5, 0.5]]
    assert weighted.tolist() == [[1.75, -1.25, 1.25]]


def test_groups_use_their_own_scales_and_short_last_group():
    # 1 row, 20 columns, groups of 8: 8 + 8 + 4 (short); all bits set -> +scale of each group
    signs = torch.tensor([[0xFF, 0xFF, 0x0F]], dtype=torch.uint8)
    p = BitDeltaPacked(shape=(20,), rows=1, cols=20, group_size=8, signs=signs,
                       scales=torch.tensor([[1.0, 2.0, 4.0]]))
    q = BitDeltaPacked(shape=(20,), rows=1, cols=20, group_size=8, signs=torch.zeros_like(signs),
                       scales=torch.tensor([[0.5, 0.5, 0.5]]))
    out = packed_mean([p, q])
    assert out.tolist() == [[0.25] * 8 + [0.75] * 8 + [1.75] * 4]


def test_one_flipped_bit_changes_exactly_that_element():
    rng = np.random.default_rng(0)
    ps = [make_packed(rng, rows=3, cols=40, group_size=16) for _ in range(5)]
    before = packed_mean(ps)
    signs = ps[2].signs.clone()
    signs[1, 2] ^= np.uint8(1 << 3)  # row 1, column 2*8+3 = 19
    ps[2] = BitDeltaPacked(shape=ps[2].shape, rows=3, cols=40, group_size=16, signs=signs, scales=ps[2].scales)
    after = packed_mean(ps)
    changed = (before != after).nonzero().tolist()
    assert changed == [[1, 19]]
    step = 2 * float(ps[2].scales[1, 1]) / 5  # sign flip of one contributor of five, group 1
    assert abs(abs(float(after[1, 19] - before[1, 19])) - step) <= 4 * EPS32 * step


@settings(max_examples=60, deadline=None)
@given(n=st.integers(1, 12), rows=st.integers(1, 6), cols=st.integers(1, 70),
       group=st.sampled_from(["row", 8, 16, 32]), weighted=st.booleans(), seed=st.integers(0, 2**32 - 1))
def test_matches_decoded_reference(n, rows, cols, group, weighted, seed):
    rng = np.random.default_rng(seed)
    group_size = cols if group == "row" or group >= cols else group
    ps = [make_packed(rng, rows=rows, cols=cols, group_size=group_size) for _ in range(n)]
    weights = rng.uniform(0.0, 3.0, n).tolist() if weighted else None
    if weights is not None and sum(weights) == 0:
        weights[0] = 1.0
    out = packed_mean(ps, weights=weights).numpy()
    ref, mag = reference64(ps, weights)
    assert out.shape == (rows, cols) and out.dtype == np.float32
    # within float32 rounding of the exact sum (a few ulps of the terms' magnitude)
    np.testing.assert_array_less(np.abs(out - ref), 3 * EPS32 * mag + 1e-30)


def test_multithreaded_chunks_and_permutation_invariance():
    # 300 x 300 spans several row chunks (and threads when torch has more than one)
    rng = np.random.default_rng(1)
    ps = [make_packed(rng, rows=300, cols=300, group_size=128) for _ in range(9)]
    w = rng.uniform(0.1, 1.0, 9).tolist()
    out = packed_mean(ps, weights=w).numpy()
    ref, mag = reference64(ps, w)
    np.testing.assert_array_less(np.abs(out - ref), 3 * EPS32 * mag)
    order = [8, 3, 0, 5, 1, 7, 2, 6, 4]
    permuted = packed_mean([ps[i] for i in order], weights=[w[i] for i in order]).numpy()
    np.testing.assert_array_less(np.abs(permuted - ref), 3 * EPS32 * mag)


def test_weights_are_normalised_and_zero_weight_ignored():
    rng = np.random.default_rng(2)
    ps = [make_packed(rng, rows=4, cols=24, group_size=8) for _ in range(3)]
    a = packed_mean(ps, weights=[1.0, 3.0, 0.0])
    b = packed_mean(ps, weights=[0.25, 0.75, 0.0])
    c = packed_mean(ps[:2], weights=[1.0, 3.0])
    assert torch.equal(a, b) and torch.equal(a, c)
    assert not torch.equal(a, packed_mean(ps))


def test_errors_name_the_argument():
    rng = np.random.default_rng(3)
    p = make_packed(rng, rows=2, cols=16, group_size=8)
    with pytest.raises(AggregationError, match="`packed` is empty"):
        packed_mean([])
    with pytest.raises(InvalidDeltaError, match=r"`packed\[1\]` has layout"):
        packed_mean([p, make_packed(rng, rows=2, cols=16, group_size=16)])
    with pytest.raises(AggregationError, match="`weights` has 1 entries for 2"):
        packed_mean([p, p], weights=[1.0])
    for bad in ([1.0, -1.0], [0.0, 0.0], [1.0, float("nan")]):
        with pytest.raises(AggregationError, match="`weights` must be finite"):
            packed_mean([p, p], weights=bad)
    wrong = BitDeltaPacked(shape=(2, 16), rows=2, cols=16, group_size=8, signs=p.signs.to(torch.int16),
                           scales=p.scales)
    with pytest.raises(InvalidDeltaError, match=r"`packed\[0\].signs` must be uint8"):
        packed_mean([wrong])


# ---- whole-model mean over a PackedModel ------------------------------------------------------
from zoo_gym.aggregation.packed_mean import model_mean  # noqa: E402
from zoo_gym.aggregation.packed_model import PackedModel  # noqa: E402


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(1, 5), st.integers(1, 300)), min_size=1, max_size=5),
       groups=st.lists(st.sampled_from(["row", 8, 16, 64, 128]), min_size=5, max_size=5),
       n=st.integers(1, 11), seed=st.integers(0, 2**32 - 1))
def test_model_mean_every_tensor_matches_decoded_reference(shapes, groups, n, seed):
    # several tensors of mixed layouts in one packed vector (word sizes, padding, uniform or not)
    rng = np.random.default_rng(seed)
    gsize = [c if groups[t] == "row" or groups[t] >= c else groups[t] for t, (r, c) in enumerate(shapes)]
    models = [[make_packed(rng, rows=r, cols=c, group_size=gsize[t]) for t, (r, c) in enumerate(shapes)]
              for _ in range(n)]
    w = rng.uniform(0.0, 2.0, n)
    w[rng.integers(0, n)] = 1.0  # never all zero
    if n > 2:
        w[0] = 0.0  # an unselected contributor must not count
    outs = model_mean(PackedModel.build(models), weights=w.tolist())
    assert len(outs) == len(shapes)
    for t, out in enumerate(outs):
        ref, mag = reference64([m[t] for m in models], w.tolist())
        assert tuple(out.shape) == shapes[t] and out.dtype == torch.float32
        np.testing.assert_array_less(np.abs(out.numpy() - ref), 3 * EPS32 * mag + 1e-30)


def test_model_mean_threads_give_identical_bits():
    # chunks are independent, so any thread count writes exactly the same floats
    rng = np.random.default_rng(5)
    models = [[make_packed(rng, rows=600, cols=1000, group_size=128),  # ~10 chunks
               make_packed(rng, rows=1, cols=77, group_size=77)] for _ in range(10)]
    pm = PackedModel.build(models)
    one = model_mean(pm, threads=1)
    three = model_mean(pm, threads=3)
    assert all(torch.equal(a, b) for a, b in zip(one, three))
    ref, mag = reference64([m[0] for m in models], None)
    np.testing.assert_array_less(np.abs(one[0].numpy() - ref), 3 * EPS32 * mag)
