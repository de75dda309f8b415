"""BitDelta: a 1-bit sign code with one scale per group.

Liu et al., "BitDelta: Your Fine-Tune May Only Be Worth One Bit" (NeurIPS 2024, arXiv:2402.10193).
A delta ``x`` is coded as ``s * sign(x)`` with ``s = mean |x|`` per group, the L2-optimal scale, so
``err^2 = sum x^2 - sum_g n_g s_g^2`` exactly (relative error ``sqrt(1 - 2/pi) = 0.603`` on Gaussian data).
Packed view (exact for XOR and popcount): ``signs`` is uint8 (rows, ceil(cols/8)), bit 1 = ``x >= 0``
(decodes to ``+s``), bit 0 = ``-s``, numpy ``packbits(bitorder="little")`` order, each row padded with
0 bits to a whole byte. Groups are a multiple of 8 long (or the whole row), so each starts on a byte.
Both directions work in row chunks of about 1 MiB; decoding builds the float32 bits (scale OR a sign
mask), which is ``scale * sign`` exactly because scales are finite and >= 0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from numba import njit
from torch import Tensor

from zoo_gym.codec.errors import CodecError
from zoo_gym.codec.layout import Groups

__all__ = ["BitDeltaPacked", "pack_bitdelta", "unpack_bitdelta", "unpack_bitdelta_into", "group_counts"]

_CHUNK_ELEMS = 1 << 18  # elements per row chunk: 1 MiB of float32


def _chunk_rows(cols: int) -> int:
    return max(1, _CHUNK_ELEMS // max(cols, 1))


def group_counts(*, cols: int, groups: Groups) -> np.ndarray:
    """int64 (n_groups,): real elements per group (the last group may be short)."""
    counts = np.full(groups.n_groups, groups.size, dtype=np.int64)
    counts[-1] = cols - groups.size * (groups.n_groups - 1)
    return counts


def _group_abs_sums(a: np.ndarray, *, cols: int, groups: Groups, out: np.ndarray) -> None:
    """Sum |x| per group of a chunk: a (r, cols) already |x|; out (r, n_groups) float64."""
    g = groups.size
    full = cols // g
    if full:
        out[:, :full] = a[:, : full * g].reshape(a.shape[0], full, g).sum(axis=-1, dtype=np.float32)
    if full < groups.n_groups:
        out[:, full] = a[:, full * g :].sum(axis=-1, dtype=np.float32)


def pack_bitdelta(x2d: Tensor, *, groups: Groups) -> tuple[np.ndarray, np.ndarray]:
    """Sign bits and float64 mean-|x| scales of a (rows, cols) float tensor.

    Returns ``signs`` uint8 (rows, ceil(cols/8)) and ``scales`` float64 (scale_rows, n_groups), the
    exact group means before rounding to the stored scale dtype. Raises CodecError on NaN/inf.
    """
    rows, cols = x2d.shape
    signs = np.empty((rows, -(-cols // 8)), dtype=np.uint8)  # (rows, nbytes)
    sums = np.empty((rows, groups.n_groups), dtype=np.float64)  # (rows, n_groups)
    step = _chunk_rows(cols)
    tmp = np.empty((min(step, rows), cols), dtype=np.float32)
    mask = np.empty((min(step, rows), cols), dtype=bool)
    for i in range(0, rows, step):
        c = x2d[i : i + step]
        if c.dtype != torch.float32:
            c = c.float()
        cn = c.numpy()  # (r, cols)
        r = cn.shape[0]
        np.abs(cn, out=tmp[:r])
        _group_abs_sums(tmp[:r], cols=cols, groups=groups, out=sums[i : i + r])
        np.greater_equal(cn, 0, out=mask[:r])
        signs[i : i + r] = np.packbits(mask[:r], axis=-1, bitorder="little")
    if not np.isfinite(sums).all():
        raise CodecError("tensor contains NaN or inf (or values so large their group sum overflows float32)")
    counts = group_counts(cols=cols, groups=groups).astype(np.float64)
    if groups.scale_rows < rows:
        total = sums.sum(axis=0, keepdims=True)  # (1, 1): one scale for the whole tensor
        return signs, total / (counts * rows)
    return signs, sums / counts


# byte value -> 8 uint32 sign masks, little bit order: bit k set -> 0 (keep +s), clear -> the sign bit
_SIGN_LUT = np.where((np.arange(256)[:, None] >> np.arange(8)[None, :]) & 1 == 1, 0, 1 << 31).astype(np.uint32)


@njit(nogil=True, cache=True, inline="always")
def _unpack_row(brow, srow, lut, g, cols, orow, base):
    """orow[base + c] = the float32 bits of +-scale for one row: its group's scale bits OR the byte's sign mask
    (uint32 views; groups start on a byte)."""
    for c0 in range(0, cols, g):
        s = srow[c0 // g]
        c1 = min(c0 + g, cols)
        full = c0 + (c1 - c0) // 8 * 8
        for b in range(c0 >> 3, full >> 3):
            m = lut[brow[b]]
            for k in range(8):
                orow[base + 8 * b + k] = s | m[k]
        if full < c1:
            m = lut[brow[full >> 3]]
            for c in range(full, c1):
                orow[base + c] = s | m[c - full]


@njit(nogil=True, cache=True)
def _unpack_rows(signs, scale_bits, lut, g, cols, out_bits):
    """Every row of signs (rows, nbytes) into out_bits (rows, cols); scale_bits (1 or rows, n_groups). Compiled
    because numpy's table lookup wrote every mask out and OR-ed them in a second pass."""
    one = scale_bits.shape[0] == 1
    for i in range(signs.shape[0]):
        _unpack_row(signs[i], scale_bits[0] if one else scale_bits[i], lut, g, cols, out_bits[i], 0)


@njit(nogil=True, cache=True)
def _unpack_stacked(signs, scale_bits, lut, g, cols, idx, j0, j1, r0, r1, out_bits):
    """Rows [r0, r1) of contributors [j0, j1) of signs (k, rows, nbytes), scale_bits (k, rows, n_groups), into
    out_bits[idx[j]] ((n, (r1 - r0) x cols) uint32), the rows one after another."""
    for j in range(j0, j1):
        orow = out_bits[idx[j]]
        for q in range(r0, r1):
            _unpack_row(signs[j, q], scale_bits[j, q], lut, g, cols, orow, (q - r0) * cols)


def unpack_bitdelta_into(signs: Tensor, scales: Tensor, idx: Tensor, *, r0: int, r1: int, cols: int,
                         group_size: int, out: Tensor, j0: int = 0, j1: int | None = None) -> None:
    """Rows [r0, r1) of stacked BitDelta tensors, contributors [j0, j1): signs uint8 (k, rows, nbytes), scales
    float32 (k, rows, n_groups), into out[idx[j]] (a float32 (n, (r1 - r0) x cols) tensor), the numbers
    `unpack_bitdelta` gives; nothing allocated. Releases the GIL: callers may split the contributors."""
    n_groups = scales.shape[2]
    g = group_size if n_groups > 1 else cols
    _unpack_stacked(signs.numpy(), scales.numpy().view(np.uint32), _SIGN_LUT, max(g, 1), cols,
                    idx.numpy().astype(np.int64, copy=False), j0, idx.numel() if j1 is None else j1, r0, r1,
                    out.numpy().view(np.uint32))


def unpack_bitdelta(signs: np.ndarray, scales: np.ndarray, *, cols: int, groups: Groups) -> np.ndarray:
    """float32 (rows, cols) = scale * sign, exactly; ``scales`` float32 (scale_rows, n_groups), finite, >= 0."""
    rows = signs.shape[0]
    out = np.empty((rows, cols), dtype=np.float32)
    scale_bits = np.ascontiguousarray(scales, dtype=np.float32).view(np.uint32)  # (scale_rows, n_groups)
    g = groups.size if groups.n_groups > 1 else cols  # one group: the whole row
    _unpack_rows(np.ascontiguousarray(signs), scale_bits, _SIGN_LUT, max(g, 1), cols, out.view(np.uint32))
    return out


def _checked_layout(p: "BitDeltaPacked") -> tuple | None:
    sg, sc = p.signs, p.scales
    if type(p.rows) is not int or type(p.cols) is not int:
        return None
    if not (isinstance(sg, Tensor) and isinstance(sc, Tensor) and sg.dtype == torch.uint8
            and sc.dtype == torch.float32 and sg.is_cpu and sc.is_cpu and sg.is_contiguous()
            and sc.is_contiguous() and sc.dim() == 2 and tuple(sg.shape) == (p.rows, -(-p.cols // 8))):
        return None
    scale_rows, n_groups = sc.shape
    if scale_rows not in (1, p.rows) or (n_groups > 1 and not (
            type(p.group_size) is int and p.group_size > 0 and p.group_size % 8 == 0
            and n_groups == -(-p.cols // p.group_size))):
        return None
    return (tuple(p.shape), p.rows, p.cols, p.group_size, scale_rows, n_groups)


@dataclass(frozen=True)
class BitDeltaPacked:
    """The packed view of one bitdelta tensor, without decoding to floats (see module docstring)."""

    shape: tuple[int, ...]  # original shape
    rows: int
    cols: int  # the 2-D view
    group_size: int  # effective group length along a row (== cols for per-row / per-tensor)
    signs: Tensor  # uint8 (rows, ceil(cols/8)), bit 1 = +scale, little bit order, rows zero-padded
    scales: Tensor  # float32 (rows, n_groups); a per-tensor scale is broadcast to (rows, 1)
    # (shape, rows, cols, group_size, scale rows, n_groups) when signs and scales are CPU,
    # C-contiguous, uint8 / float32 and shaped as above, else None. Checked once here, so the
    # aggregation can lay out many tensors by reading this instead of re-checking each tensor
    # (about 1 us of torch calls per tensor). The tensors must not be resized in place afterwards.
    checked_layout: tuple | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "checked_layout", _checked_layout(self))

    def group_counts(self) -> Tensor:
        """int64 (n_groups,): real elements per group (the last group may be short)."""
        n_groups = self.scales.shape[1]
        return torch.from_numpy(
            group_counts(cols=self.cols, groups=Groups(size=self.group_size, n_groups=n_groups, scale_rows=self.rows))
        )

    def sq_norm(self) -> float | None:
        """||to_dense()||^2 in float64 from the scales alone (every element is + or - its group's float32 scale, so
        the sum of n_g s_g^2 is the decoded rows' up to float64 rounding); None when a scale is not finite."""
        s = self.scales.to(torch.float64)
        if not bool(torch.isfinite(s).all()):
            return None
        per_row = (s.square() * self.group_counts().to(torch.float64)).sum()
        return float(per_row) * (self.rows if s.shape[0] == 1 else 1)

    def rows_dense(self, r0: int, r1: int) -> Tensor:
        """float32 (r1 - r0, cols): rows [r0, r1) of `to_dense()`, the same numbers, decoding those rows only."""
        groups = Groups(size=self.group_size, n_groups=self.scales.shape[1], scale_rows=r1 - r0)  # scales: (rows, g)
        return torch.from_numpy(unpack_bitdelta(self.signs[r0:r1].numpy(), self.scales[r0:r1].numpy(),
                                                cols=self.cols, groups=groups))

    def to_dense(self) -> Tensor:
        """float32 (rows, cols) = scale * sign, exactly what decode returns before the dtype cast."""
        groups = Groups(size=self.group_size, n_groups=self.scales.shape[1], scale_rows=self.rows)
        return torch.from_numpy(
            unpack_bitdelta(self.signs.numpy(), self.scales.numpy(), cols=self.cols, groups=groups)
        )
