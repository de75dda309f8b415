"""Batched BitDelta linear: ``x W^T (+ bias) + per row b: (x_b S_v^T) * scale_v`` with packed signs.

Plain torch reference (placeholder until the compiled kernels land): the signs are unpacked one tile
of output rows at a time, so no dense per-variant copy of a weight ever exists.
"""

from __future__ import annotations

import torch
from torch import Tensor

_BITS = torch.arange(8, dtype=torch.uint8)
_TILE_ROWS = 256


def unpack_rows(signs: Tensor, scales: Tensor, *, cols: int, group_size: int) -> Tensor:
    """float32 (r, cols) = scale * sign of a few packed rows (uint8 (r, ceil(cols/8)), scales (r, n_groups))."""
    bits = (signs.unsqueeze(-1) >> _BITS.to(signs.device)) & 1  # (r, nbytes, 8)
    s = bits.reshape(signs.shape[0], -1)[:, :cols].to(torch.float32) * 2 - 1  # (r, cols) +-1
    if scales.shape[1] == 1:
        return s * scales
    return s * scales.repeat_interleave(group_size, dim=1)[:, :cols]


def bitdelta_linear(x: Tensor, weight: Tensor, bias: Tensor | None, signs: list[Tensor], scales: list[Tensor],
                    group_size: int, variant_of_row: Tensor) -> Tensor:
    """x (B, T, in), weight (out, in) -> (B, T, out); variant_of_row (B,) indexes signs/scales (-1: base only)."""
    y = torch.nn.functional.linear(x, weight, bias)  # (B, T, out)
    out_f, in_f = weight.shape
    for v in torch.unique(variant_of_row).tolist():
        if v < 0:
            continue
        rows = (variant_of_row == v).nonzero().squeeze(1)
        xv = x.index_select(0, rows).to(torch.float32)  # (n, T, in)
        dv = torch.empty(xv.shape[:-1] + (out_f,), dtype=torch.float32, device=x.device)
        for r0 in range(0, out_f, _TILE_ROWS):
            r1 = min(out_f, r0 + _TILE_ROWS)
            tile = unpack_rows(signs[v][r0:r1], scales[v][r0:r1], cols=in_f, group_size=group_size)  # (tile, in)
            dv[..., r0:r1] = xv @ tile.T
        y.index_add_(0, rows, dv.to(y.dtype))
    return y
