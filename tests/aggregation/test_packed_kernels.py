"""The compiled BitDelta kernels against plain numpy on decoded bits, on every code path:
one word per group, two words per group, groups of different lengths, thread splits, and a
contributor count that is not a multiple of four."""

from __future__ import annotations

import numpy as np
import pytest

from zoo_gym.aggregation.packed_kernels import sq_distances, warm_up, weighted_sum

BYTES = {np.uint8: 1, np.uint16: 2, np.uint32: 4, np.uint64: 8}


def _decoded(words: np.ndarray, scales: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """(n, bits) float64 s * (2 b - 1) straight from the bits, group by group."""
    u8 = words.view(np.uint8)
    bits = np.unpackbits(u8, axis=1, bitorder="little").astype(np.float64) * 2 - 1  # (n, bits)
    wb = words.dtype.itemsize
    per_bit = np.repeat(np.arange(len(ends) - 1), np.diff(ends) * wb * 8)          # group of each bit
    return bits * scales[:, per_bit]


def _case(rng, n: int, dtype, group_words: list[int]):
    ends = np.concatenate([[0], np.cumsum(group_words)]).astype(np.int64)
    words = rng.integers(0, np.iinfo(dtype).max, (n, ends[-1]), dtype=dtype, endpoint=True)
    scales = rng.uniform(1e-4, 1e-2, (n, len(group_words)))
    return words, scales, ends


@pytest.mark.parametrize("dtype,group_words,uniform", [
    (np.uint64, [2] * 300, 2),            # the codec default: groups of 128 bits in two words
    (np.uint64, [1] * 300, 1),
    (np.uint16, [3, 1, 5, 2] * 40, 0),    # groups of different lengths: the generic loop
    (np.uint8, [4] * 50, 0),              # uniform but not unrolled: also the generic loop
])
def test_sq_distances_equal_decoded_differences(dtype, group_words, uniform):
    rng = np.random.default_rng(0)
    words, scales, ends = _case(rng, 7, dtype, group_words)
    counts = np.diff(ends).astype(np.float64) * BYTES[dtype] * 8  # every bit counts here
    out = np.zeros((7, 7))
    sq_distances(words, scales, counts, ends, uniform, 0, len(group_words), out)
    x = _decoded(words, scales, ends)
    ref = ((x[:, None, :] - x[None, :, :]) ** 2).sum(-1)
    assert np.all(np.tril(out) == 0.0)  # upper triangle only; the diagonal is never touched
    np.testing.assert_allclose(np.triu(out, 1), np.triu(ref, 1), rtol=1e-12, atol=0)
    # two ranges of groups (what two threads compute) add up to the whole
    half = np.zeros((7, 7))
    cut = len(group_words) // 3
    sq_distances(words, scales, counts, ends, uniform, 0, cut, half)
    sq_distances(words, scales, counts, ends, uniform, cut, len(group_words), half)
    np.testing.assert_allclose(half, out, rtol=1e-13, atol=0)


@pytest.mark.parametrize("m", [1, 3, 4, 6, 9])
def test_weighted_sum_equals_decoded_mean(m):
    rng = np.random.default_rng(m)
    words, scales, ends = _case(rng, 10, np.uint8, [16] * 20 + [3, 7, 1])  # last groups short
    chosen = rng.choice(10, size=m, replace=False)
    w = rng.uniform(0.1, 1.0, m)
    w /= w.sum()
    pad = -m % 4
    rows = np.concatenate([chosen, np.full(pad, chosen[0])]).astype(np.int64)
    weights = np.concatenate([w, np.zeros(pad)])
    out = np.full(ends[-1] * 8, np.nan, dtype=np.float32)
    weighted_sum(words, scales, rows, weights, ends, 0, len(ends) - 1, out)
    x = _decoded(words, scales, ends)
    ref = (w[:, None] * x[chosen]).sum(0)
    mag = (w[:, None] * np.abs(x[chosen])).sum(0)
    eps = float(np.finfo(np.float32).eps)
    assert not np.isnan(out).any()  # every element written, padding rows included
    np.testing.assert_array_less(np.abs(out - ref), (1.5 + m / 8) * eps * mag)


def test_warm_up_compiles_every_word_width():
    warm_up()
    for dtype in BYTES:
        assert any(sig[0].dtype.name == np.dtype(dtype).name for sig in sq_distances.signatures)
