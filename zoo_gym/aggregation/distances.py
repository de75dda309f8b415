"""Accurate pairwise squared distances between deltas, dense or straight from BitDelta bits.

Flower's Krum computes ||x||^2 + ||y||^2 - 2 x.y in float32 on full weights; when deltas are
small against the weights, the three terms are huge and nearly cancel, and the result is off by
percents. Here we (1) work on deltas, (2) centre each column chunk by its contributor mean
(distances are translation invariant, so this is exact maths and removes the common part),
(3) accumulate in float64, and (4) set the diagonal exactly to 0.

Compressed domain (BitDelta, Liu et al. 2024, arXiv:2402.10193): inside a group of c elements
with scales sx, sy where k signs differ,
    ||x - y||^2 = (c - k)(sx - sy)^2 + k(sx + sy)^2 = c(sx - sy)^2 + 4 k sx sy,
and k is a popcount of the XOR of the packed sign bytes. No decoding to float32 happens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ._checks import check_deltas
from .errors import InvalidDeltaError

_CHUNK = 1 << 16  # columns per float64 chunk: (n, 65536) float64 = n * 512 KiB


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


def _popcount_groups(xor: np.ndarray, *, group_bytes: int, n_groups: int) -> np.ndarray:
    """Differing-sign counts per group: uint8 (..., rows, nbytes) -> int64 (..., rows, n_groups)."""
    nbytes = xor.shape[-1]
    if n_groups == 1:
        if nbytes % 8 == 0:
            return np.bitwise_count(xor.view(np.uint64)).sum(axis=-1, dtype=np.int64)[..., None]
        return np.bitwise_count(xor).sum(axis=-1, dtype=np.int64)[..., None]
    if n_groups * group_bytes == nbytes and group_bytes in (1, 2, 4, 8):
        wide = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[group_bytes]
        return np.bitwise_count(np.ascontiguousarray(xor).view(wide)).astype(np.int64)
    pad = n_groups * group_bytes - nbytes
    counts = np.bitwise_count(xor)
    if pad:
        counts = np.concatenate([counts, np.zeros(counts.shape[:-1] + (pad,), np.uint8)], axis=-1)
    return counts.reshape(counts.shape[:-1] + (n_groups, group_bytes)).sum(axis=-1, dtype=np.int64)


def _check_packed(packed: Sequence[Any]) -> tuple[int, int, int, int]:
    if len(packed) == 0:
        raise InvalidDeltaError("`packed` is empty: need at least one BitDeltaPacked")
    p0 = packed[0]
    layout = (p0.rows, p0.cols, p0.group_size, tuple(p0.scales.shape))
    for i, p in enumerate(packed):
        if (p.rows, p.cols, p.group_size, tuple(p.scales.shape)) != layout:
            raise InvalidDeltaError(
                f"`packed[{i}]` has layout rows={p.rows} cols={p.cols} group_size={p.group_size} "
                f"scales={tuple(p.scales.shape)}, but packed[0] has {layout}; compressed-domain "
                "distances need identical layouts (decode and use pairwise_sq_distances instead)")
        if p.scales.shape[0] not in (1, p.rows):
            raise InvalidDeltaError(f"`packed[{i}].scales` must have {p.rows} or 1 rows, got "
                                    f"{tuple(p.scales.shape)}")
        if p.signs.dtype != torch.uint8:
            raise InvalidDeltaError(f"`packed[{i}].signs` must be uint8, got {p.signs.dtype}")
    n_groups = int(p0.scales.shape[1])
    nbytes = int(p0.signs.shape[1])
    group_bytes = nbytes if n_groups == 1 else p0.group_size // 8
    if n_groups > 1 and p0.group_size % 8 != 0:
        raise InvalidDeltaError(f"group_size={p0.group_size} must be a multiple of 8 when a row "
                                "has several groups (groups must start on byte boundaries)")
    return p0.rows, nbytes, n_groups, group_bytes


def packed_sq_norms(packed: Sequence[Any]) -> Tensor:
    """(n,) float64 squared L2 norms of BitDelta tensors: sum over groups of c * s^2."""
    _check_packed(packed)
    counts = packed[0].group_counts().to(torch.float64)  # (n_groups,)
    rep = packed[0].rows // packed[0].scales.shape[0]  # 1, or rows for one scale row per tensor
    return torch.stack([(p.scales.to(torch.float64) ** 2 * counts).sum() * rep for p in packed])


def packed_pairwise_sq_distances(packed: Sequence[Any], *, scale: Tensor | None = None) -> Tensor:
    """(n, n) float64 squared distances between BitDelta-packed tensors, from bits and scales.

    `packed`: n BitDeltaPacked with identical layout (rows, cols, group_size).
    `scale`:  optional (n,) multipliers applied to contributor i's delta (e.g. clip factors),
              folded into the scales, so distances of clipped deltas need no decoding either.
    """
    rows, nbytes, n_groups, group_bytes = _check_packed(packed)
    n = len(packed)
    counts = packed[0].group_counts().to(torch.float64).numpy()            # (n_groups,)
    mult = (np.ones(n) if scale is None
            else torch.as_tensor(scale, dtype=torch.float64).numpy())      # (n,)
    scales = np.stack([p.scales.to(torch.float64).numpy() for p in packed]) * mult[:, None, None]
    signs = np.stack([p.signs.numpy() for p in packed])                    # (n, rows, nbytes) uint8
    rep = rows // scales.shape[1]  # scales (n, rows | 1, g): one scale row may serve all rows
    out = np.zeros((n, n), dtype=np.float64)
    for i in range(n - 1):
        xor = np.bitwise_xor(signs[i][None], signs[i + 1:])                # (n-i-1, rows, nbytes)
        k = _popcount_groups(xor, group_bytes=group_bytes, n_groups=n_groups)  # (n-i-1, rows, g)
        si, sj = scales[i][None], scales[i + 1:]                           # (1|m, rows, g)
        diff = ((si - sj) ** 2 * counts).sum(axis=(1, 2)) * rep            # (m,)
        cross = 4.0 * (k * si * sj).sum(axis=(1, 2))                       # (m,)
        out[i, i + 1:] = diff + cross
    out = out + out.T
    np.fill_diagonal(out, 0.0)
    return torch.from_numpy(out)
