"""Encode and decode ONE tensor with one dense codec (bitdelta, int8, int4, fp16, bf16, fp32).

A leaf is the unit the container stores: data bytes, then (for the quantised codecs) the scales,
starting on an 8-byte boundary. Decoding checks the body values it can check cheaply: finite,
non-negative scales; zero padding bits; integer codes the encoder never writes; finite values.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from zoo_gym.codec.bitdelta import BitDeltaPacked, pack_bitdelta
from zoo_gym.codec.errors import CodecError
from zoo_gym.codec.intquant import QMAX, absmax_scales, dequantize, pack_int4, quantize, unpack_int4
from zoo_gym.codec.layout import PASSTHROUGH_CODECS, groups_for, leaf_parts, resolve_scale_dtype, view_2d
from zoo_gym.codec.logscale import log8_codes, log8_from_bytes, log8_scales, log8_to_bytes

__all__ = ["Leaf", "TORCH_DTYPES", "dtype_name", "encode_leaf", "decode_leaf", "decode_leaf_rows", "packed_leaf"]

TORCH_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_NAMES = {v: k for k, v in TORCH_DTYPES.items()}


def dtype_name(dtype: torch.dtype, *, what: str) -> str:
    if dtype not in _NAMES:
        raise CodecError(f"{what}: dtype {dtype} is not supported; deltas must be float32, bfloat16 or float16")
    return _NAMES[dtype]


@dataclass(frozen=True)
class Leaf:
    """One encoded tensor before it is placed in a payload."""

    codec: str
    shape: tuple[int, ...]
    dtype: str  # dtype name of the original tensor
    group_size: int | None
    scale_dtype: str | None
    data: np.ndarray  # uint8 (data bytes,)
    scales: np.ndarray | None  # uint8 (scale bytes,)

    @property
    def nbytes(self) -> int:
        data, scale_off, scale_bytes = leaf_parts(
            codec=self.codec, shape=self.shape, group_size=self.group_size, scale_dtype=self.scale_dtype
        )
        return data if not scale_bytes else scale_off + scale_bytes

    def decode(self) -> Tensor:
        return decode_leaf(self.data, self.scales, codec=self.codec, shape=self.shape, dtype=self.dtype,
                           group_size=self.group_size, scale_dtype=self.scale_dtype, what="tensor")


def _u8(t: Tensor) -> np.ndarray:
    """Raw bytes of a tensor as uint8 (n,)."""
    return t.reshape(-1).contiguous().view(torch.uint8).numpy()


def _store_scales(s: Tensor | np.ndarray, *, scale_dtype: str, log8_mode: str = "nearest") -> tuple[np.ndarray, Tensor]:
    """(stored bytes, the stored scales read back as float32) of scales (scale_rows, n_groups).

    ``log8_mode`` picks the log8 grid point: "nearest" (bitdelta) or "ceil" (int codes never clip).
    """
    if scale_dtype == "log8":
        ref, codes = log8_codes(np.asarray(s), mode=log8_mode)  # float64 scales keep the nearest choice exact
        return log8_to_bytes(ref, codes), torch.from_numpy(log8_scales(ref, codes))
    if isinstance(s, np.ndarray):
        s = torch.from_numpy(s).float()
    stored = s.to(TORCH_DTYPES[scale_dtype]).contiguous()
    return _u8(stored), stored.float()


def _scales_from_bytes(raw: np.ndarray, *, scale_dtype: str, shape: tuple[int, int], what: str) -> np.ndarray:
    if scale_dtype == "log8":
        return log8_from_bytes(raw, shape=shape, what=what)  # validated, finite and >= 0 by construction
    s = torch.from_numpy(np.array(raw, dtype=np.uint8)).view(TORCH_DTYPES[scale_dtype]).float().reshape(shape)
    if not bool(torch.isfinite(s).all()) or bool((s < 0).any()):
        raise CodecError(f"{what}: scales must be finite and >= 0; the body is corrupt")
    return s.numpy()


def encode_leaf(x: Tensor, *, codec: str, group_size: int | None, scale_dtype: str | None, what: str) -> Leaf:
    """Encode one tensor (any supported float dtype, any shape) with one dense codec.

    ``scale_dtype`` None takes the codec's default (:func:`zoo_gym.codec.layout.resolve_scale_dtype`).
    """
    dtype = dtype_name(x.dtype, what=what)
    shape = tuple(x.shape)
    if math.prod(shape) == 0:
        raise CodecError(f"{what}: empty tensor of shape {shape}; drop it from the delta")
    x = x.detach().cpu().contiguous()
    if codec in PASSTHROUGH_CODECS:
        if not bool(torch.isfinite(x).all()):
            raise CodecError(f"{what}: tensor contains NaN or inf")
        y = x.to(TORCH_DTYPES[PASSTHROUGH_CODECS[codec]])
        if not bool(torch.isfinite(y).all()):
            raise CodecError(f"{what}: values exceed the range of {codec}; use codec 'bf16' or 'fp32'")
        return Leaf(codec, shape, dtype, None, None, _u8(y), None)
    scale_dtype = resolve_scale_dtype(scale_dtype, codec=codec, group_size=group_size)
    rows, cols = view_2d(shape)
    groups = groups_for(rows=rows, cols=cols, group_size=group_size, codec=codec)
    x2d = x.reshape(rows, cols)
    if codec == "bitdelta":
        try:
            signs, means = pack_bitdelta(x2d, groups=groups)
        except CodecError as e:
            raise CodecError(f"{what}: {e}") from None
        raw, _ = _store_scales(means if scale_dtype == "log8" else torch.from_numpy(means).float(),
                               scale_dtype=scale_dtype)
        return Leaf(codec, shape, dtype, group_size, scale_dtype, signs.reshape(-1), raw)
    xf = x2d.float()
    if not bool(torch.isfinite(xf).all()):
        raise CodecError(f"{what}: tensor contains NaN or inf")
    qmax = QMAX[codec]
    amax = absmax_scales(xf, groups=groups, qmax=qmax)  # (scale_rows, n_groups)
    raw, stored = _store_scales(amax.numpy() if scale_dtype == "log8" else amax, scale_dtype=scale_dtype,
                                log8_mode="ceil")
    q = quantize(xf, stored, groups=groups, qmax=qmax)  # int8 (rows, cols)
    data = _u8(q) if codec == "int8" else pack_int4(q)
    return Leaf(codec, shape, dtype, group_size, scale_dtype, data, raw)


def decode_leaf(
    data: np.ndarray,
    scales: np.ndarray | None,
    *,
    codec: str,
    shape: tuple[int, ...],
    dtype: str,
    group_size: int | None,
    scale_dtype: str | None,
    what: str,
) -> Tensor:
    """The tensor (original shape and dtype) of one leaf; ``data``/``scales`` are its raw uint8 bytes."""
    if codec == "bitdelta":
        packed = packed_leaf(data, scales, shape=shape, group_size=group_size, scale_dtype=scale_dtype, what=what)
        dense = packed.to_dense()  # float32 (rows, cols) = scale * sign
        return dense.reshape(shape).to(TORCH_DTYPES[dtype])
    rows, _ = view_2d(shape)
    out = decode_leaf_rows(data, scales, codec=codec, shape=shape, dtype=dtype, group_size=group_size,
                           scale_dtype=scale_dtype, r0=0, r1=rows, what=what)
    if out is None:
        raise CodecError(f"{what}: unknown codec {codec!r}")
    return out.reshape(shape)


def decode_leaf_rows(data: np.ndarray, scales: np.ndarray | None, *, codec: str, shape: tuple[int, ...], dtype: str,
                     group_size: int | None, scale_dtype: str | None, r0: int, r1: int, what: str) -> Tensor | None:
    """Rows [r0, r1) of one leaf's 2-D view ((r1 - r0, cols), the original dtype) of a passthrough or integer
    codec, from those rows' bytes (and the scales) alone, so a row block of a wide tensor costs its rows, not the
    tensor (`decode_leaf` is all its rows). None where int4 rows do not start and end on a byte, and for bitdelta
    (whose rows BitDeltaPacked.rows_dense reads)."""
    rows, cols = view_2d(shape)
    if not 0 <= r0 <= r1 <= rows:
        raise CodecError(f"{what}: rows [{r0}, {r1}) are outside its {rows} rows")
    out_dtype = TORCH_DTYPES[dtype]
    if r0 == r1:
        return torch.empty((0, cols), dtype=out_dtype)
    if codec in PASSTHROUGH_CODECS:
        stored = TORCH_DTYPES[PASSTHROUGH_CODECS[codec]]
        size = stored.itemsize
        part = np.array(data[r0 * cols * size:r1 * cols * size], dtype=np.uint8)
        y = torch.from_numpy(part).view(stored)
        if not bool(torch.isfinite(y).all()):
            raise CodecError(f"{what}: {codec} values contain NaN or inf; the body is corrupt")
        return y.reshape(r1 - r0, cols).to(out_dtype)
    first, n = r0 * cols, (r1 - r0) * cols
    if codec not in ("int8", "int4") or (codec == "int4" and (first % 2 or (n % 2 and r1 < rows))):
        return None  # int4: two codes a byte, so the rows must start on one and end on one (or at the padding)
    groups = groups_for(rows=rows, cols=cols, group_size=group_size, codec=codec)
    s = torch.from_numpy(_scales_from_bytes(scales, scale_dtype=scale_dtype, shape=(groups.scale_rows, groups.n_groups),
                                            what=what))
    if groups.scale_rows == rows:
        s = s[r0:r1]
    if codec == "int8":
        q = torch.from_numpy(np.array(data[r0 * cols:r1 * cols], dtype=np.uint8)).view(torch.int8)
        if bool((q == -128).any()):
            raise CodecError(f"{what}: int8 code -128 is never written by the encoder; the body is corrupt")
    else:
        try:
            q = unpack_int4(data[first // 2:(first + n + 1) // 2], numel=n)
        except CodecError as e:
            raise CodecError(f"{what}: {e}") from None
    return dequantize(q.reshape(r1 - r0, cols), s, groups=groups).to(out_dtype)


def packed_leaf(
    data: np.ndarray, scales: np.ndarray | None, *, shape: tuple[int, ...], group_size: int | None,
    scale_dtype: str | None, what: str,
) -> BitDeltaPacked:
    """The validated packed view of a bitdelta leaf (copies the bytes out of the payload)."""
    rows, cols = view_2d(shape)
    groups = groups_for(rows=rows, cols=cols, group_size=group_size, codec="bitdelta")
    nb = -(-cols // 8)
    signs = np.array(data, dtype=np.uint8).reshape(rows, nb)  # (rows, ceil(cols/8))
    if cols % 8 and bool((signs[:, -1] >> (cols % 8)).any()):
        raise CodecError(f"{what}: padding bits after the last column are not zero; the body is corrupt")
    s = _scales_from_bytes(scales, scale_dtype=scale_dtype, shape=(groups.scale_rows, groups.n_groups), what=what)
    s = np.broadcast_to(s, (rows, groups.n_groups)).copy()  # (rows, n_groups)
    return BitDeltaPacked(shape=shape, rows=rows, cols=cols, group_size=groups.size,
                          signs=torch.from_numpy(signs), scales=torch.from_numpy(s))
