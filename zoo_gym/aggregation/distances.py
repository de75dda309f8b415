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
XOR + popcount (the CPU's POPCNT) per word pair in one compiled loop (`packed_kernels.py`) over
that vector (`PackedModel`, in packed_model.py), instead of Python work per tensor and per pair;
ranges of groups are shared among threads (the kernel releases the GIL).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ._checks import check_deltas
from .errors import InvalidDeltaError
from .packed_kernels import in_group_ranges, sq_distances
from .packed_model import PackedModel, check_models

_CHUNK = 1 << 16  # columns per float64 chunk: (n, 65536) float64 = n * 512 KiB
_MIN_WORD_PAIRS_PER_THREAD = 1 << 20  # XOR + popcounts (about 1 ms) worth waking a thread


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
def _sq_distances(model: PackedModel, g0: int, g1: int) -> np.ndarray:
    """(n, n) upper triangle of the squared distances over groups g0..g1 (compiled kernel)."""
    n, n_words = model.words.shape
    out = np.zeros((n, n), dtype=np.float64)
    ends = np.append(model.starts, n_words)  # (G + 1,) int64
    sq_distances(model.words, model.scales, model.counts, ends, model.group_words, g0, g1, out)
    return out


def model_sq_distances(model: PackedModel, *, threads: int | None = None) -> np.ndarray:
    """(n, n) float64 squared distances between the contributors of `model`, diagonal exactly 0.

    The groups are shared among `threads` (default `torch.get_num_threads()`, fewer when there
    is too little work per thread); the compiled kernel releases the GIL, so the threads run in
    parallel. No BLAS call runs inside the threads (its own pool would oversubscribe the cores).
    The result does not depend on the thread count beyond float64 summation order.
    """
    n, n_words = model.words.shape
    if n == 1:
        return np.zeros((1, 1))
    if threads is None:  # small models: handing work to a thread costs more than it saves
        threads = min(torch.get_num_threads(), n * (n - 1) // 2 * n_words // _MIN_WORD_PAIRS_PER_THREAD)
    parts = in_group_ranges(lambda g0, g1: _sq_distances(model, g0, g1), model.counts.shape[0], threads)
    out = parts[0]
    for part in parts[1:]:
        out += part
    out += out.T
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
