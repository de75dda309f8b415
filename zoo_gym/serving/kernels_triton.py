"""CUDA kernel of ``bitdelta_linear``'s per-variant part (Triton), used when the input is on a GPU.

One program per (variant slot, block of BLOCK_N outputs, block of BLOCK_M of that variant's tokens); the
variant's packed signs and scales are reached through a table of addresses (no copy). Inside the K loop
a tile of sign bits is unpacked to ``+-scale`` and multiplied with the x tile by ``tl.dot`` in float32
(IEEE, not TF32, to match the CPU path); the result is added to the base output in place.
tests/serving/test_kernels.py compares it with the CPU path when CUDA is present.
Design and references: docs/design/serving.md.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import triton
import triton.language as tl
from torch import Tensor

from zoo_gym.codec.logscale import LOG8_MULT
from zoo_gym.serving.scale_codes import float_scales

BLOCK_M, BLOCK_N, BLOCK_K = 16, 64, 64


@triton.jit
def _delta_add_kernel(x_ptr, y_ptr, tok_ptr, tok_start_ptr, sign_addr_ptr, scale_addr_ptr, scale_rows_ptr,
                      ref_ptr, lut_ptr, n_out, n_in, nbytes, n_groups, group_size,
                      LOG8: tl.constexpr, ALIGNED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      BLOCK_K: tl.constexpr):
    v = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_m = tl.program_id(2)
    t0 = tl.load(tok_start_ptr + v)
    t1 = tl.load(tok_start_ptr + v + 1)
    m0 = t0 + pid_m * BLOCK_M
    if m0 < t1:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < t1
        toks = tl.load(tok_ptr + offs_m, mask=mask_m, other=0).to(tl.int64)  # rows of x / y (flattened)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n_out
        signs = tl.load(sign_addr_ptr + v).to(tl.pointer_type(tl.uint8))
        if LOG8:  # uint8 log8 codes: scale = float32(ref * LUT[code]), as the CPU path decodes them
            codes = tl.load(scale_addr_ptr + v).to(tl.pointer_type(tl.uint8))
            ref = tl.load(ref_ptr + v)
        else:
            scales = tl.load(scale_addr_ptr + v).to(tl.pointer_type(tl.float32))
        srow = tl.where(tl.load(scale_rows_ptr + v) > 1, offs_n, 0).to(tl.int64)  # (N,) one row: per tensor
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, n_in, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            mask_k = offs_k < n_in
            xt = tl.load(x_ptr + toks[:, None] * n_in + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                         other=0.0).to(tl.float32)  # (M, K)
            if ALIGNED:  # the K block lies in one scale group: one scale per column, each sign byte read once
                offs_b = k0 // 8 + tl.arange(0, BLOCK_K // 8)
                mb = (offs_b < nbytes)[:, None] & mask_n[None, :]
                byte = tl.load(signs + offs_n[None, :].to(tl.int64) * nbytes + offs_b[:, None], mask=mb,
                               other=0).to(tl.int32)  # (K / 8, N)
                bit = (byte[:, None, :] >> tl.arange(0, 8)[None, :, None]) & 1  # (K / 8, 8, N): k = 8 b + i
                pm = tl.reshape(tl.where(bit != 0, 1.0, -1.0), (BLOCK_K, BLOCK_N))
                at = srow * n_groups + k0 // group_size  # (N,) scale index
                if LOG8:
                    sc = ref * tl.load(lut_ptr + tl.load(codes + at, mask=mask_n, other=0).to(tl.int32))
                else:
                    sc = tl.load(scales + at, mask=mask_n, other=0.0)
                acc += tl.dot(xt, pm, input_precision="ieee") * sc[None, :]
            else:  # groups narrower than the K block: a scale per (k, n)
                mk = mask_k[:, None] & mask_n[None, :]
                byte = tl.load(signs + offs_n[None, :].to(tl.int64) * nbytes + (offs_k // 8)[:, None], mask=mk,
                               other=0).to(tl.int32)  # (K, N)
                bit = (byte >> (offs_k % 8)[:, None]) & 1
                at = srow[None, :] * n_groups + (offs_k // group_size)[:, None]  # (K, N) scale index
                if LOG8:
                    sc = ref * tl.load(lut_ptr + tl.load(codes + at, mask=mk, other=0).to(tl.int32))
                else:
                    sc = tl.load(scales + at, mask=mk, other=0.0)
                acc += tl.dot(xt, tl.where(bit != 0, sc, -sc), input_precision="ieee")
        yp = y_ptr + toks[:, None] * n_out + offs_n[None, :]
        my = mask_m[:, None] & mask_n[None, :]
        y = tl.load(yp, mask=my, other=0.0).to(tl.float32)
        tl.store(yp, (y + acc).to(y_ptr.dtype.element_ty), mask=my)


@functools.lru_cache(maxsize=64)
def _routing(variant_of_row: bytes, per_row: int, device: torch.device) -> tuple[list[int], Tensor, Tensor, int]:
    """(used variant slots, flat token rows grouped by slot, tok_start (n_used + 1,), most tokens of one slot)
    for a batch's int64 slots (as bytes, -1 = base), the tensors on `device`: computed once per batch, as
    every adapted linear of a forward asks with the same rows."""
    vr = np.frombuffer(variant_of_row, dtype=np.int64)
    used = sorted(set(vr[vr >= 0].tolist()))
    toks = [(np.flatnonzero(vr == v)[:, None] * per_row + np.arange(per_row)).reshape(-1) for v in used]
    counts = np.concatenate([[0], np.cumsum([t.size for t in toks])]).astype(np.int64)
    tok = torch.from_numpy(np.concatenate(toks).astype(np.int64)).to(device)
    return used, tok, torch.from_numpy(counts).to(device), int(max(t.size for t in toks))


@functools.lru_cache(maxsize=1024)
def _on_device(values: tuple, device: torch.device, dtype: torch.dtype = torch.int64) -> Tensor:
    """Tensor of `values` on `device` (addresses, row counts, log8 references): one host-to-device copy per
    distinct table instead of one per call; a table of addresses is the same whichever tensor later lives there."""
    return torch.tensor(values, dtype=dtype, device=device)


@functools.lru_cache(maxsize=8)
def _log8_table(device: torch.device) -> Tensor:
    """The codec's 256 log8 multipliers (float32) on `device`."""
    return torch.from_numpy(LOG8_MULT).to(device=device, dtype=torch.float32)


def triton_delta_add(y: Tensor, x: Tensor, signs: list[Tensor], scales: list[Tensor], group_size: int,
                     variant_of_row: Tensor, *, scale_refs: list[float] | None = None) -> Tensor:
    """y (B, ..., out) += each row's variant delta of x (B, ..., in), in place on the GPU; returns y.

    ``variant_of_row`` int64 (B,) on the CPU (the grouping of rows by variant is done there). With
    ``scale_refs``, ``scales[v]`` are uint8 log8 codes decoded inside the kernel (kernels.log8_scale_codes).
    """
    out_f, in_f = y.shape[-1], x.shape[-1]
    x2 = x.reshape(-1, in_f).contiguous()
    y2 = y.view(-1, out_f)
    per_row = x2.shape[0] // x.shape[0]
    dev = x.device
    used, tok, tok_start, max_tok = _routing(variant_of_row.to(torch.int64).contiguous().numpy().tobytes(),
                                             per_row, dev)
    sg = [signs[v].contiguous() for v in used]  # held until the kernel is queued: read by address
    refs_used = [None if scale_refs is None else scale_refs[v] for v in used]
    log8 = all(r is not None for r in refs_used)  # codes decoded in the kernel; else float32 scales
    # a batch that mixes log8-coded and float32 variants runs the float32 kernel (the CPU path's decoding)
    sc = [(scales[v] if log8 else float_scales(scales[v], r).to(torch.float32)).contiguous()
          for v, r in zip(used, refs_used)]
    n_groups = sc[0].shape[1]
    gs = group_size if n_groups > 1 else in_f + 8  # one group per row: every column in group 0
    sign_addr = _on_device(tuple(s.data_ptr() for s in sg), dev)
    scale_addr = _on_device(tuple(c.data_ptr() for c in sc), dev)
    scale_rows = _on_device(tuple(c.shape[0] for c in sc), dev)
    refs = _on_device(tuple(float(r) for r in refs_used) if log8 else (0.0,), dev, torch.float32)
    grid = (len(used), triton.cdiv(out_f, BLOCK_N), triton.cdiv(max_tok, BLOCK_M))
    _delta_add_kernel[grid](x2, y2, tok, tok_start, sign_addr, scale_addr, scale_rows, refs, _log8_table(dev),
                            out_f, in_f, sg[0].shape[1], n_groups, gs, LOG8=log8,
                            ALIGNED=n_groups == 1 or gs % BLOCK_K == 0, BLOCK_M=BLOCK_M,
                            BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K)
    return y
