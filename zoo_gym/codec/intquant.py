"""Symmetric absmax integer codes per group: int8 (codes -127..127) and int4 (codes -7..7).

Dettmers et al., "LLM.int8()" (NeurIPS 2022, arXiv:2208.07339) for absmax quantisation; groups as in
GPTQ/AWQ-style group-wise 4-bit codes. ``scale = max |x| / qmax`` per group; ``q = round(x / scale)``
clamped to [-qmax, qmax]; decoding gives ``q * scale`` in float32. The code -128 (int8) and the nibble
0 (int4, stored as ``q + 8``) are never written, so the decoder rejects them as corruption.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from zoo_gym.codec.errors import CodecError
from zoo_gym.codec.layout import Groups

__all__ = ["QMAX", "absmax_scales", "quantize", "dequantize", "pack_int4", "unpack_int4"]

QMAX: dict[str, int] = {"int8": 127, "int4": 7}


def _grouped(x2d: Tensor, *, groups: Groups) -> Tensor:
    """(rows, n_groups, G) zero-padded view of a (rows, cols) float32 tensor."""
    rows, cols = x2d.shape
    pad = groups.size * groups.n_groups - cols
    if pad:
        x2d = torch.nn.functional.pad(x2d, (0, pad))
    return x2d.reshape(rows, groups.n_groups, groups.size)


def absmax_scales(x2d: Tensor, *, groups: Groups, qmax: int) -> Tensor:
    """float32 (scale_rows, n_groups): max |x| / qmax per group."""
    rows = x2d.shape[0]
    amax = _grouped(x2d, groups=groups).abs().amax(dim=-1)  # (rows, n_groups)
    if groups.scale_rows < rows:  # one scale for the whole tensor
        amax = amax.amax().reshape(1, 1)
    return amax / qmax


def quantize(x2d: Tensor, scales: Tensor, *, groups: Groups, qmax: int) -> Tensor:
    """int8 (rows, cols) codes in [-qmax, qmax] for float32 ``x2d`` and the STORED scales (float32)."""
    rows, cols = x2d.shape
    s = scales.expand(rows, groups.n_groups).unsqueeze(-1)  # (rows, n_groups, 1)
    safe = torch.where(s > 0, s, torch.ones_like(s))
    q = torch.round(_grouped(x2d, groups=groups) / safe).clamp_(-qmax, qmax)
    q = torch.where(s > 0, q, torch.zeros_like(q))
    return q.reshape(rows, -1)[:, :cols].to(torch.int8)


def dequantize(q: Tensor, scales: Tensor, *, groups: Groups) -> Tensor:
    """float32 (rows, cols) = q * scale."""
    rows, cols = q.shape
    s = scales.expand(rows, groups.n_groups).unsqueeze(-1)  # (rows, n_groups, 1)
    return (_grouped(q.float(), groups=groups) * s).reshape(rows, -1)[:, :cols]


def pack_int4(q: Tensor) -> np.ndarray:
    """uint8 (ceil(n/2),): codes q in [-7, 7] stored as q + 8; element 2k low nibble, 2k+1 high; pad nibble 0."""
    flat = (q.reshape(-1).to(torch.int16) + 8).to(torch.uint8)
    if flat.numel() % 2:
        flat = torch.cat([flat, flat.new_zeros(1)])
    pairs = flat.reshape(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).numpy()


def unpack_int4(packed: np.ndarray, *, numel: int) -> Tensor:
    """int8 (numel,) codes from :func:`pack_int4`; raises CodecError on a code that was never written."""
    p = torch.from_numpy(np.array(packed, dtype=np.uint8))
    nib = torch.stack([p & 0x0F, p >> 4], dim=-1).reshape(-1)  # (2 * nbytes,)
    if numel % 2 and int(nib[-1]) != 0:
        raise CodecError("int4 payload has a non-zero padding nibble: the body is corrupt")
    nib = nib[:numel]
    if bool((nib == 0).any()):
        raise CodecError("int4 payload holds the code -8, which the encoder never writes: the body is corrupt")
    return (nib.to(torch.int16) - 8).to(torch.int8)
