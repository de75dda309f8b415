"""Weighted mean of packed BitDelta deltas, without decoding each one to floats.

BitDelta (Liu et al., NeurIPS 2024, arXiv:2402.10193) codes contributor i's tensor as
``s_i[r, g] * (2 b_i - 1)`` with sign bits ``b_i`` and one scale per (row, group). Multi-Krum
(Blanchard et al., NeurIPS 2017) then averages the selected deltas:
``out = sum_i w_i s_i (2 b_i - 1)``.

Trick (a bit-sliced lookup, as in bit-serial / LUT-based low-bit GEMM kernels, e.g. T-MAC,
Wei et al. 2024, arXiv:2407.00088): take contributors in blocks of 8. For each element the 8
sign bits form one byte ``code`` (bit i = contributor i), obtained from the 8 packed sign bytes
by an 8x8 bit-matrix transpose (Hacker's Delight, 2nd ed., section 7-3) on one uint64. Within a
(row, group) every contributor's coefficient ``c_i = w_i s_i`` is constant, so the block's value
is a function of ``code`` alone: a 256-entry table per (row, group), built from two 16-entry
halves (contributors 0-3 and 4-7, summed in float64) and added once in float32. The per-element
work is then one index add and one gather per block of 8 contributors, instead of 8 decodes and
8 multiply-adds; the table costs 256 entries per group (2 per element at groups of 128).

Rounding: each half is computed in float64 and rounded once to float32; the table entry is their
float32 sum. So every output is within about 1.5 float32 ulps of the exact sum (the float32
reference that decodes and adds one contributor at a time rounds n times).

Work runs over a `PackedModel` (all tensors of a model laid end to end, see packed_model.py) in
chunks of about 128k elements: codes, half tables, the (hi, lo, group) table and indices stay in
cache (the table is laid out with the group last, so building it is one add with a long inner
loop; an element's entry is code * groups + group) and a model of many small tensors costs a few large
numpy calls instead of several per tensor. The chunks are shared among
``torch.get_num_threads()`` threads (numpy releases the GIL in the calls used here; numpy alone,
so no OpenMP team or BLAS pool competes with those threads).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch
from torch import Tensor

from zoo_gym.codec.bitdelta import BitDeltaPacked

from .errors import AggregationError, InvalidDeltaError
from .packed_model import PackedModel

__all__ = ["model_mean", "packed_mean"]

_CHUNK_ELEMS = 1 << 17  # output elements per chunk (512 KiB float32; index 2x, table 2x)
_CHUNK_GROUPS = 1024  # group tables per chunk (1 MiB): fewer, longer numpy calls hold the GIL less
_MIN_ELEMS_PER_THREAD = 1 << 20  # below this, one thread is faster than starting a pool
_BLOCK = 8  # contributors per code byte

# Hacker's Delight 7-3: transpose the 8x8 bit matrix held in a uint64 (bit 8*i + k <-> 8*k + i)
_T_STEPS = (
    (np.uint64(7), np.uint64(0x00AA00AA00AA00AA)),
    (np.uint64(14), np.uint64(0x0000CCCC0000CCCC)),
    (np.uint64(28), np.uint64(0x00000000F0F0F0F0)),
)


def _transpose8(x: np.ndarray, t: np.ndarray) -> None:
    """In place: x uint64 (m,), byte i bit k -> byte k bit i. t is scratch of the same shape."""
    for shift, mask in _T_STEPS:
        np.right_shift(x, shift, out=t)
        np.bitwise_xor(t, x, out=t)
        np.bitwise_and(t, mask, out=t)
        np.bitwise_xor(x, t, out=x)
        np.left_shift(t, shift, out=t)
        np.bitwise_xor(x, t, out=x)


def _normalised(weights: Sequence[float] | None, n: int) -> np.ndarray:
    """float64 (n,) weights summing to 1 (uniform when None); refuses bad weights by name."""
    if weights is None:
        return np.full(n, 1.0 / n)
    w = np.asarray([float(x) for x in weights], dtype=np.float64)
    if w.shape != (n,):
        raise AggregationError(f"`weights` has {w.shape[0]} entries for {n} packed deltas; give one per delta")
    if not np.isfinite(w).all() or (w < 0).any() or w.sum() <= 0:
        raise AggregationError(f"`weights` must be finite, >= 0 and not all zero, got {w.tolist()}")
    return w / w.sum()


# (4, 1) signs of a contributor pair's 2-bit codes: bit 0 -> first contributor, bit 1 -> second
_PAIR_A = np.array([[-1.0], [1.0], [-1.0], [1.0]])
_PAIR_B = np.array([[-1.0], [-1.0], [1.0], [1.0]])


def _half_tables(coef: np.ndarray, pair: np.ndarray, out: np.ndarray) -> None:
    """out (32, c) float32 = [lo | hi] half tables from coef (8, c) float64 (w_i * s_i, zero rows
    for missing contributors): lo[j] = sum_{i<4} coef_i (+1 if bit i of j else -1), hi likewise
    for contributors 4..7. Sums of 2-bit pair tables in float64, rounded once; every call loops
    over the c groups (long inner loops), `pair` (2, 4, c) is scratch."""
    for half in range(2):
        q = coef[4 * half:4 * half + 4]
        for p in range(2):  # pair p: contributors 2p, 2p + 1 of this half -> (4, c)
            np.multiply(_PAIR_A, q[2 * p], out=pair[p])
            pair[p] += _PAIR_B * q[2 * p + 1]
        # code (b << 2) | a: pair 1 gives the high two bits
        np.add(pair[1][:, None, :], pair[0][None, :, :],
               out=out[16 * half:16 * half + 16].reshape(4, 4, -1), casting="same_kind")


def _segments(model: PackedModel) -> list[tuple[int, int, int]]:
    """Runs of consecutive groups with the same padded length: (first group, end group, bytes),
    cut into chunks of about _CHUNK_ELEMS elements."""
    wb = model.word_bytes
    ends = np.append(model.starts, model.words.shape[1])
    lengths = np.diff(ends) * wb  # (G,) padded bytes per group
    cuts = np.flatnonzero(np.diff(lengths)) + 1
    edges = np.concatenate([[0], cuts, [len(lengths)]]).tolist()
    out = []
    for a, b in zip(edges[:-1], edges[1:]):
        nb = int(lengths[a])
        step = max(1, min(_CHUNK_ELEMS // (nb * 8), _CHUNK_GROUPS))
        out += [(g, min(g + step, b), nb) for g in range(a, b, step)]
    return out


def _run_chunks(chunks, *, model: PackedModel, blocks: list, out: np.ndarray) -> None:
    """Fill out (flat float32, one value per sign bit) for the given chunks.

    numpy only, on purpose: numpy's elementwise calls never start threads of their own, so the
    worker threads of `model_mean` are the only parallelism (torch ops would open an OpenMP team
    per worker thread, and BLAS its own pool; both stall badly when a core is busy)."""
    u8 = model.words.view(np.uint8)  # (n, padded bytes)
    wb = model.word_bytes
    max_bytes = max((g1 - g0) * nb for g0, g1, nb in chunks)
    max_groups = max(g1 - g0 for g0, g1, _ in chunks)
    stacked = np.empty((max_bytes, _BLOCK), dtype=np.uint8)   # (bytes, 8) one byte per contributor
    tmp64 = np.empty(max_bytes, dtype=np.uint64)
    idx = np.empty(max_bytes * 8, dtype=np.intp)              # (elements,) table index
    table = np.empty(256 * max_groups, dtype=np.float32)      # (hi, lo, groups) flat
    acc = np.empty(max_bytes * 8, dtype=np.float32) if len(blocks) > 1 else None
    halves = np.empty((32, max_groups), dtype=np.float32)    # [lo | hi] per group of the chunk
    coef = np.zeros((_BLOCK, max_groups))                     # (8, groups) w_i * s_i
    pair = np.empty((2, 4, max_groups))                       # 2-bit pair tables
    ofs_cache: dict[tuple[int, int], np.ndarray] = {}
    for g0, g1, nb in chunks:
        c, b0 = g1 - g0, int(model.starts[g0]) * wb
        nbytes, el = c * nb, c * nb * 8
        key = (c, nb)
        if key not in ofs_cache:  # (el,) each element's group within the chunk
            ofs_cache[key] = np.repeat(np.arange(c, dtype=np.intp), nb * 8)
        dst = out[b0 * 8:b0 * 8 + el]
        for k, (who, wk) in enumerate(blocks):
            st = stacked[:nbytes]
            if len(who) == _BLOCK:  # (bytes, 8): byte j of contributor who[i] at st[j, i]
                np.stack([u8[i, b0:b0 + nbytes] for i in who], axis=1, out=st)
            else:
                st[:, len(who):] = 0
                for j, i in enumerate(who):
                    st[:, j] = u8[i, b0:b0 + nbytes]
            _transpose8(st.reshape(-1).view(np.uint64), tmp64[:nbytes])
            codes = st.reshape(-1)  # (el,) uint8, bit i = block contributor i
            cf = coef[:, :c]
            np.multiply(model.scales[who, g0:g1], wk[:, None], out=cf[:len(who)])
            cf[len(who):] = 0.0
            _half_tables(cf, pair[:, :, :c], halves[:, :c])
            h = halves[:, :c]  # (32, c) = [lo | hi]
            tab = table[:256 * c].reshape(16, 16, c)  # (hi, lo, group): the long loop is over groups
            np.add(h[16:, None, :], h[None, :16, :], out=tab)
            ix = idx[:el]  # entry of element e: code_e * c + its group
            np.multiply(codes, np.intp(c), out=ix)
            np.add(ix, ofs_cache[key], out=ix)
            target = dst if k == 0 else acc[:el]
            np.take(table[:256 * c], ix, out=target, mode="clip")
            if k:
                np.add(dst, target, out=dst)


def model_mean(model: PackedModel, *, weights: Sequence[float] | None = None,
               threads: int | None = None) -> list[Tensor]:
    """Per-tensor float32 sum_i w_i * scale_i * sign_i over the contributors of `model`.

    Weights are normalised (uniform when None); contributors of weight 0 cost nothing, so a
    Multi-Krum average passes the model built for distances with zeros for the unselected.
    Returns one tensor per packed tensor, shaped like it (views into one flat buffer where the
    layout has no padding inside rows).
    """
    n = model.words.shape[0]
    w = _normalised(weights, n)
    rows = [i for i in range(n) if w[i] > 0]
    flat = torch.empty(model.words.shape[1] * model.word_bytes * 8, dtype=torch.float32)
    chunks = _segments(model)
    if threads is None:
        threads = min(torch.get_num_threads(), flat.numel() // _MIN_ELEMS_PER_THREAD)
    threads = max(1, min(threads, len(chunks)))
    blocks = [(rows[b:b + _BLOCK], w[rows[b:b + _BLOCK]]) for b in range(0, len(rows), _BLOCK)]
    kw = dict(model=model, blocks=blocks, out=flat.numpy())
    if threads == 1:
        _run_chunks(chunks, **kw)
    else:
        per = -(-len(chunks) // threads)
        with ThreadPoolExecutor(max_workers=threads) as pool:
            for f in [pool.submit(_run_chunks, chunks[a:a + per], **kw)
                      for a in range(0, len(chunks), per)]:
                f.result()
    return model.split(flat)


def _check(packed: Sequence[BitDeltaPacked]) -> None:
    """Refuse an empty list and layouts that disagree, naming the first bad entry."""
    if len(packed) == 0:
        raise AggregationError("`packed` is empty: pass at least one BitDeltaPacked to average")
    p0 = packed[0]
    nbytes = -(-p0.cols // 8)
    for i, p in enumerate(packed):
        if (p.rows, p.cols, p.group_size) != (p0.rows, p0.cols, p0.group_size):
            raise InvalidDeltaError(
                f"`packed[{i}]` has layout rows={p.rows} cols={p.cols} group_size={p.group_size}, "
                f"but `packed[0]` has rows={p0.rows} cols={p0.cols} group_size={p0.group_size}; "
                "all contributors must be coded with the same layout")
        if p.signs.dtype != torch.uint8 or tuple(p.signs.shape) != (p.rows, nbytes):
            raise InvalidDeltaError(
                f"`packed[{i}].signs` must be uint8 ({p.rows}, {nbytes}), got "
                f"{p.signs.dtype} {tuple(p.signs.shape)}")


def packed_mean(packed: Sequence[BitDeltaPacked], *, weights: Sequence[float] | None = None) -> Tensor:
    """float32 (rows, cols) = sum_i w_i * scale_i * sign_i, weights normalised (uniform when None).

    Every delta must share rows, cols and group_size. Matches averaging the decoded deltas
    (`BitDeltaPacked.to_dense`) to within float32 rounding (see the module docstring).
    """
    _check(packed)
    w = _normalised(weights, len(packed))
    p0 = packed[0]
    if p0.rows * p0.cols == 0:
        return torch.empty((p0.rows, p0.cols), dtype=torch.float32)
    model = PackedModel.build([[p] for p in packed])
    return model_mean(model, weights=w).pop(0).reshape(p0.rows, p0.cols)
