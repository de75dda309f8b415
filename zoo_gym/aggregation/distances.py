"""Exact pairwise squared distances between deltas, dense or straight from BitDelta bits, and exact
distances from every delta to a combination of the deltas (Weiszfeld, centered clipping).

Dense: every distance is summed from the differences (x_i - x_j)^2 in float64, column block by column
block, never from ||x||^2 + ||y||^2 - 2 x.y; the relative error of every pair is below (d + 2) 2^-53.
Compressed (BitDelta, Liu et al. 2024, arXiv:2402.10193): per group of c elements with scales sx, sy
and k differing signs, ||x - y||^2 = c(sx - sy)^2 + 4 k sx sy, k a popcount of the XOR of the packed
sign words of a `PackedModel`; nothing is decoded to float32. Why exact, and the cost:
docs/design/aggregation.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from . import dense_kernels
from ._checks import check_deltas
from .errors import InvalidDeltaError
from .packed_kernels import in_group_ranges, sq_distances
from .packed_model import PackedModel, check_models

_BLOCK_ELEMENTS = 1 << 20  # float64 elements per column block: (n, c) float64 = 8 MiB
_MIN_WORD_PAIRS_PER_THREAD = 1 << 20  # XOR + popcounts (about 1 ms) worth waking a thread


def _block(n: int) -> int:
    """Columns per float64 block of n rows."""
    return max(1024, _BLOCK_ELEMENTS // max(n, 1))


def pairwise_sq_distances(deltas: Tensor, *, threads: int | None = None) -> Tensor:
    """(n, n) float64 squared L2 distances between the rows of `deltas` (n, d); diagonal exactly 0,
    exactly symmetric. Summed from float64 differences (module docstring): exact for any finite
    input up to float64 rounding of a sum of non-negative terms. float32 / float64 rows run through
    a compiled kernel on `threads` column ranges (default `torch.get_num_threads()`); a non-finite
    input makes a distance non-finite, so the input is checked from the result (no extra pass)."""
    deltas = check_deltas(deltas, finite=False)
    n, d = deltas.shape
    if n == 1 or deltas.dtype not in (torch.float32, torch.float64) or deltas.device.type != "cpu":
        return _torch_sq_distances(check_deltas(deltas))
    x = deltas.detach().contiguous().numpy()
    if threads is None:
        threads = min(torch.get_num_threads(), n * (n - 1) // 2 * d // _MIN_WORD_PAIRS_PER_THREAD)
    parts = in_group_ranges(lambda c0, c1: _dense_part(x, c0, c1), d, threads)
    out = parts[0]
    for part in parts[1:]:
        out += part
    if not np.isfinite(out).all():
        check_deltas(deltas)  # names the rows holding NaN or inf
    out += out.T
    return torch.from_numpy(out)


def _dense_part(x: np.ndarray, c0: int, c1: int) -> np.ndarray:
    out = np.zeros((x.shape[0], x.shape[0]))
    dense_kernels.sq_distances(x, c0, c1, out)
    return out


def _torch_sq_distances(deltas: Tensor) -> Tensor:
    """`pairwise_sq_distances` for other dtypes: float64 differences column block by column block."""
    n, d = deltas.shape
    out = torch.zeros((n, n), dtype=torch.float64)
    step = _block(n)
    for start in range(0, d, step):
        x = deltas[:, start:start + step].to(torch.float64)  # (n, c)
        for i in range(n - 1):
            diff = x[i + 1:] - x[i]  # (n - i - 1, c) exact: difference of float32 in float64
            out[i, i + 1:] += (diff * diff).sum(dim=1)
    return out + out.T


def sq_distances_to(deltas: Tensor, point: Tensor) -> Tensor:
    """(n,) float64 ||x_i - point||^2 for the rows of `deltas` (n, d) and a (d,) point, summed from
    float64 differences in column blocks (exact like `pairwise_sq_distances`)."""
    n, d = deltas.shape
    out = torch.zeros(n, dtype=torch.float64)
    step = _block(n)
    for start in range(0, d, step):
        diff = deltas[:, start:start + step].to(torch.float64) - point[start:start + step]  # (n, c)
        out += (diff * diff).sum(dim=1)
    return out


def combination_sq_distances(deltas: Tensor, coefficients: Tensor | None, *,
                             previous: Tensor | None = None) -> tuple[Tensor, float]:
    """Distances to v = sum_j a_j x_j: ((n,) float64 ||x_i - v||^2, ||v - v_prev||^2).

    v is formed in float64 per column block (a (n,) float64 coefficients), never stored whole, and
    every distance is summed from float64 differences, so a coefficient of 1e-31 on an outlier at
    1e30 and the honest points' unit distances are all resolved. `coefficients` None: v is the
    coordinate-wise lower median of the rows (Weiszfeld's robust start). `previous`: coefficients
    of the previous iterate (its distance to v, the step; nan when None). Results of the blocks
    or tensors of one model add up: call it per tensor and sum.
    """
    n, d = deltas.shape
    sq = torch.zeros(n, dtype=torch.float64)
    move = 0.0
    step = _block(n)
    a = None if coefficients is None else coefficients.to(torch.float64)
    moved = None if previous is None or a is None else a - previous.to(torch.float64)  # (n,)
    for start in range(0, d, step):
        x = deltas[:, start:start + step].to(torch.float64)  # (n, c)
        v = x.median(dim=0).values if a is None else a @ x  # (c,)
        diff = x - v
        sq += (diff * diff).sum(dim=1)
        if moved is not None:
            m = moved @ x  # (c,) v - v_prev, formed directly (no cancellation between iterates)
            move += float((m * m).sum())
    return sq, (move if moved is not None else math.nan)


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
