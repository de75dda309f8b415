"""Accurate pairwise squared distances between deltas, dense or straight from BitDelta bits.

Flower's Krum computes ||x||^2 + ||y||^2 - 2 x.y in float32 on full weights; when deltas are
small against the weights, the three terms are huge and nearly cancel, and the result is off by
percents. Here we (1) work on deltas, (2) centre each column chunk by its contributor mean
(distances are translation invariant, so this is exact maths and removes the common part),
(3) accumulate in float64, and (4) set the diagonal exactly to 0.

Compressed domain (BitDelta, Liu et al. 2024, arXiv:2402.10193): inside a group of c elements
with scales sx, sy where k signs differ,
    ||x - y||^2 = (c - k)(sx - sy)^2 + k(sx + sy)^2 = c(sx - sy)^2 + 4 k sx sy,
and k is a popcount of the XOR of the packed sign bytes. Both terms are >= 0, so the float64
sum has no cancellation. No decoding to float32 happens.

Speed: groups start on byte boundaries, so the sign bytes of every tensor of one contributor
can be laid end to end into ONE word vector (each group zero-padded to whole words; a zero pad
XORs to 0, so this is exact). All pairs are then done per cache-sized chunk of groups with one
XOR + popcount per contributor row and a segment sum over groups (`PackedModel`, in
packed_model.py), instead of Python work per tensor and per pair; the chunks are shared among
threads (numpy releases the GIL in those calls).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ._checks import check_deltas
from .errors import InvalidDeltaError
from .packed_model import PackedModel, check_models

_CHUNK = 1 << 16  # columns per float64 chunk: (n, 65536) float64 = n * 512 KiB
_CHUNK_WORDS = 1 << 14  # packed words per contributor per chunk: 16384 x 8 B = 128 KiB
_MIN_WORDS_PER_THREAD = 1 << 16  # below this many words per contributor, one thread is faster


def pairwise_sq_distances(deltas: Tensor) -> Tensor:
    """(n, n) float64 squared L2 distances between the rows of `deltas` (n, d); diagonal exactly 0."""
    deltas = check_deltas(deltas)
    n, d = deltas.shape
    out = torch.zeros((n, n), dtype=torch.float64)
    for start in range(0, d, _CHUNK):
        x = deltas[:, start:start + _CHUNK].to(torch.float64)  # (n, c)
        x = x - x.mean(dim=0, keepdim=True)                      # centred: exact, removes shared part
        sq = (x * x).sum(dim=1)                                   # (n,)
        out += sq[:, None] + sq[None, :] - 2.0 * (x @ x.T)
    out.clamp_(min=0.0)
    out.fill_diagonal_(0.0)
    return out


# ---- compressed domain --------------------------------------------------------------------------
def _chunk_bounds(model: PackedModel) -> list[int]:
    """Group indices cutting the model into chunks of about _CHUNK_WORDS words per contributor."""
    n_words = model.words.shape[1]
    n_groups = model.counts.shape[0]
    gw = model.group_words
    if gw:
        step = max(1, _CHUNK_WORDS // gw)
        return list(range(0, n_groups, step)) + [n_groups]
    marks = np.searchsorted(model.starts, np.arange(0, n_words, _CHUNK_WORDS))  # cut at group starts
    return sorted(set(marks.tolist()) | {0, n_groups})


def _sign_term(model: PackedModel, bounds: Sequence[int]) -> np.ndarray:
    """(n, n) upper triangle of sum over groups of 4 k_ij s_i s_j for the chunks in `bounds`."""
    n, n_words = model.words.shape
    out = np.zeros((n, n), dtype=np.float64)
    gw = model.group_words
    ends = np.append(model.starts, n_words)                          # (G + 1,)
    b = np.asarray(bounds)
    cw_max = int((ends[b[1:]] - ends[b[:-1]]).max())                 # widest chunk, words
    gc_max = int(np.diff(b).max())                                   # most groups in a chunk
    xor = np.empty((n - 1, cw_max), dtype=model.words.dtype)         # scratch (n-1, cw)
    bits = np.empty((n - 1, cw_max), dtype=np.uint8)                 # popcount per word
    k16 = np.empty((n - 1, gc_max), dtype=np.int16)                  # differing signs per group
    f = np.empty((n - 1, gc_max), dtype=np.float64)                  # float64 scratch
    for g0, g1 in zip(bounds[:-1], bounds[1:]):
        w0, w1 = int(ends[g0]), int(ends[g1])
        cw, gc = w1 - w0, g1 - g0
        block = model.words[:, w0:w1]             # (n, cw)
        s = model.scales[:, g0:g1]                # (n, gc)
        local = None if gw else model.starts[g0:g1] - w0
        for i in range(n - 1):
            m = n - 1 - i
            x = np.bitwise_xor(block[i], block[i + 1:], out=xor[:m, :cw])      # (m, cw)
            pc = np.bitwise_count(x, out=bits[:m, :cw])                         # (m, cw)
            if gw == 1:
                k = pc                                                          # (m, gc)
            elif 1 < gw <= 8:  # strided adds: a reduction over a short axis is slow in numpy
                k = np.add(pc[:, 0::gw], pc[:, 1::gw], out=k16[:m, :gc], dtype=np.int16)
                for j in range(2, gw):
                    np.add(k, pc[:, j::gw], out=k)
            elif gw:
                k = pc.reshape(m, gc, gw).sum(axis=-1, dtype=np.int32)          # (m, gc)
            else:
                k = np.add.reduceat(pc, local, axis=1, dtype=np.int32)         # (m, gc)
            y = np.multiply(k, s[i + 1:], out=f[:m, :gc])                        # (m, gc)
            out[i, i + 1:] += 4.0 * np.einsum("mg,g->m", y, s[i])                # (m,) no BLAS
    return out


def _scale_term(model: PackedModel) -> np.ndarray:
    """(n, n) sum over groups of c (s_i - s_j)^2: a Gram matrix of the centred, sqrt(c)-weighted
    scales (BLAS), chunk by chunk; pairs where that cancels badly are redone directly."""
    n, n_groups = model.scales.shape
    gram = np.zeros((n, n))
    for g0 in range(0, n_groups, _CHUNK):
        t = model.scales[:, g0:g0 + _CHUNK]                              # (n, gc)
        t = (t - t.mean(axis=0)) * np.sqrt(model.counts[g0:g0 + _CHUNK])  # centred: exact maths
        gram += t @ t.T
    sq = np.diag(gram).copy()                                            # (n,)
    size = sq[:, None] + sq[None, :]                                     # (n, n)
    term = np.maximum(size - 2.0 * gram, 0.0)
    for i, j in zip(*np.nonzero(np.triu(term < 1e-6 * size, k=1))):      # cancellation: redo
        term[i, j] = term[j, i] = float(((model.scales[i] - model.scales[j]) ** 2) @ model.counts)
    np.fill_diagonal(term, 0.0)
    return term


def model_sq_distances(model: PackedModel, *, threads: int | None = None) -> np.ndarray:
    """(n, n) float64 squared distances between the contributors of `model`, diagonal exactly 0.

    The chunks are shared among `threads` (default `torch.get_num_threads()`, one for small
    models); numpy releases the GIL inside the XOR / popcount / add calls, so threads run those
    in parallel. No BLAS call runs inside the threads (its own pool would oversubscribe the
    cores). The result does not depend on the thread count beyond float64 summation order.
    """
    n, n_words = model.words.shape
    if n == 1:
        return np.zeros((1, 1))
    bounds = _chunk_bounds(model)
    n_chunks = len(bounds) - 1
    if threads is None:  # small models: thread start-up costs more than it saves
        threads = min(torch.get_num_threads(), n_words // _MIN_WORDS_PER_THREAD)
    threads = max(1, min(threads, n_chunks))
    if threads == 1:
        out = _sign_term(model, bounds)
    else:
        per = -(-n_chunks // threads)
        parts = [bounds[a:a + per + 1] for a in range(0, n_chunks, per)]
        with ThreadPoolExecutor(max_workers=len(parts)) as pool:
            out = sum(pool.map(lambda b: _sign_term(model, b), parts))
    out += out.T
    out += _scale_term(model)
    np.fill_diagonal(out, 0.0)
    return out


def packed_model_sq_distances(models: Sequence[Sequence[Any]], *,
                              scale: Tensor | None = None) -> Tensor:
    """(n, n) float64 squared distances between whole BitDelta deltas, from bits and scales.

    `models[i]`: contributor i's BitDeltaPacked tensors (same order and layouts for everyone);
    the distance is over all of them together. `scale`: optional (n,) multipliers (clip factors).
    """
    return torch.from_numpy(model_sq_distances(PackedModel.build(models, scale=scale)))


def packed_sq_norms(packed: Sequence[Any]) -> Tensor:
    """(n,) float64 squared L2 norms of BitDelta tensors: sum over groups of c * s^2."""
    check_models([[p] for p in packed])
    counts = packed[0].group_counts().to(torch.float64)  # (n_groups,)
    rep = packed[0].rows // packed[0].scales.shape[0]  # 1, or rows for one scale row per tensor
    return torch.stack([(p.scales.to(torch.float64) ** 2 * counts).sum() * rep for p in packed])


def packed_pairwise_sq_distances(packed: Sequence[Any], *, scale: Tensor | None = None) -> Tensor:
    """(n, n) float64 squared distances between BitDelta-packed tensors, from bits and scales.

    `packed`: n BitDeltaPacked with identical layout (rows, cols, group_size).
    `scale`:  optional (n,) multipliers applied to contributor i's delta (e.g. clip factors),
              folded into the scales, so distances of clipped deltas need no decoding either.
    """
    if len(packed) == 0:
        raise InvalidDeltaError("`packed` is empty: need at least one BitDeltaPacked")
    return packed_model_sq_distances([[p] for p in packed], scale=scale)
