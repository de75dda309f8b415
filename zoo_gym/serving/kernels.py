"""Batched BitDelta linear: ``x W^T (+ bias) + per row b: (x_b S_v^T) * scale_v`` with packed signs.

Liu et al., "BitDelta" (arXiv:2402.10193) serve many fine-tunes over one base; Punica / S-LoRA batch
requests of different adapters into one forward. The base matmul is torch's; the per-variant part runs
on the packed signs (uint8 (out, ceil(in/8)), bit 1 = +scale, little bit order; zoo_gym/codec/bitdelta.py)
with float32 scales or the codec's log8 codes (``scale_refs=``), so no dense per-variant copy of a weight
ever exists. CPU: numba (``kernels_cpu.py``); CUDA input: Triton (``kernels_triton.py``, imported only
then). Routing is computed once per batch. Details: docs/design/serving.md.
"""

from __future__ import annotations

import functools
import math
import threading

import numpy as np
import torch
from torch import Tensor

from zoo_gym.aggregation.packed_kernels import in_group_ranges
from zoo_gym.codec.logscale import LOG8_MULT
from zoo_gym.serving import kernels_cpu
from zoo_gym.serving.scale_codes import float_scales as _scales_f32

__all__ = ["bitdelta_linear", "bitdelta_linear_reference", "log8_scale_codes", "unpack_rows", "warm_up"]

_BITS = torch.arange(8, dtype=torch.uint8)
_TILE_ROWS = 256  # rows unpacked at a time on the dense-tile path
_SCRATCH_MAX_BYTES = 8 << 20  # kernel outputs up to this size reuse one buffer per thread
_scratch_local = threading.local()
_KERNEL_MAX_TOKENS = 256  # tokens of one variant above which the tile + torch matmul path wins (measured)


def unpack_rows(signs: Tensor, scales: Tensor, *, cols: int, group_size: int) -> Tensor:
    """float32 (r, cols) = scale * sign of a few packed rows (uint8 (r, ceil(cols/8)), scales (r or 1, n_groups))."""
    bits = (signs.unsqueeze(-1) >> _BITS.to(signs.device)) & 1  # (r, nbytes, 8)
    s = bits.reshape(signs.shape[0], -1)[:, :cols].to(torch.float32) * 2 - 1  # (r, cols) +-1
    if scales.shape[1] == 1:
        return s * scales
    return s * scales.repeat_interleave(group_size, dim=1)[:, :cols]


def log8_scale_codes(scales: Tensor) -> tuple[Tensor, float]:
    """(uint8 codes, reference) with ``float32(ref * LOG8_MULT[codes]) == scales`` exactly, for float32 scales
    the codec decoded from ``log8`` (zoo_gym/codec/logscale.py): 1 byte per group in memory instead of 4,
    plus one float per tensor. ValueError when the scales are not on one log8 grid."""
    sc = scales.detach().to("cpu", torch.float32).contiguous()
    ref = sc.max() if sc.numel() else torch.tensor(0.0)
    table = ref * torch.from_numpy(LOG8_MULT)  # float32 (256,), increasing
    codes = torch.searchsorted(table, sc.reshape(-1)).clamp_(max=255).reshape(sc.shape)
    if not torch.equal(table[codes], sc):
        raise ValueError("scales are not log8-coded (one float32 reference times the 1/16-octave grid)")
    return codes.to(torch.uint8), float(ref)


def _tile_delta(xv: Tensor, signs: Tensor, scales: Tensor, *, out_f: int, in_f: int, group_size: int) -> Tensor:
    """float32 (..., out) = xv (..., in) float32 @ (S * scale)^T, unpacking _TILE_ROWS rows at a time."""
    dv = torch.empty(xv.shape[:-1] + (out_f,), dtype=torch.float32, device=xv.device)
    per_tensor = scales.shape[0] == 1
    for r0 in range(0, out_f, _TILE_ROWS):
        r1 = min(out_f, r0 + _TILE_ROWS)
        sc = scales if per_tensor else scales[r0:r1]
        tile = unpack_rows(signs[r0:r1], sc, cols=in_f, group_size=group_size)  # (tile, in)
        dv[..., r0:r1] = xv @ tile.T
    return dv


def bitdelta_linear_reference(x: Tensor, weight: Tensor, bias: Tensor | None, signs: list[Tensor],
                              scales: list[Tensor], group_size: int, variant_of_row: Tensor, *,
                              scale_refs: list[float] | None = None) -> Tensor:
    """Plain torch version of :func:`bitdelta_linear` (tiles of unpacked rows): the tests' second opinion."""
    y = torch.nn.functional.linear(x, weight, bias)  # (B, T, out)
    out_f, in_f = weight.shape
    for v in torch.unique(variant_of_row).tolist():
        if v < 0:
            continue
        rows = (variant_of_row == v).nonzero().squeeze(1)
        xv = x.index_select(0, rows).to(torch.float32)  # (n, T, in)
        sc = _scales_f32(scales[v], scale_refs[v] if scale_refs else None)
        dv = _tile_delta(xv, signs[v], sc, out_f=out_f, in_f=in_f, group_size=group_size)
        y.index_add_(0, rows, dv.to(y.dtype))
    return y


def _check_packed(signs: list[Tensor], scales: list[Tensor], refs: list[float | None], *, out_f: int, in_f: int,
                  group_size: int) -> None:
    """ValueError unless every variant's signs/scales fit an (out_f, in_f) weight with one group layout."""
    nbytes = -(-in_f // 8)
    n_groups = scales[0].shape[1] if scales and scales[0].dim() == 2 else -1
    for s, c, ref in zip(signs, scales, refs):
        if ref is None:
            ok = c.is_floating_point()
        else:  # log8 codes and their reference
            ok = c.dtype == torch.uint8 and math.isfinite(ref) and ref >= 0
        ok = (ok and s.dtype == torch.uint8 and tuple(s.shape) == (out_f, nbytes) and c.dim() == 2
              and c.shape[1] == n_groups and c.shape[0] in (1, out_f) and s.device == c.device)
        if ok and n_groups > 1:
            ok = group_size > 0 and group_size % 8 == 0 and -(-in_f // group_size) == n_groups
        if not ok:
            raise ValueError(f"packed signs {tuple(s.shape)} {s.dtype} / scales {tuple(c.shape)} do not fit a "
                             f"({out_f}, {in_f}) weight with groups of {group_size}")


def _kernel_x(xs: Tensor, width: int, group_bytes: int) -> np.ndarray:
    """xs (n_tok, in) as the kernel reads it: zero-padded to `width` inputs; bf16 bits in the bf16 kernel's
    lane order where that kernel applies (bf16 input, groups of whole 32-bit words, CPU support), else float32."""
    n_tok, in_f = xs.shape
    bf16 = xs.dtype == torch.bfloat16 and kernels_cpu.HAS_BF16_DOT and group_bytes % 4 == 0
    dtype = torch.bfloat16 if bf16 else torch.float32
    if width != in_f:
        xp = torch.zeros((n_tok, width), dtype=dtype)
        xp[:, :in_f] = xs
    else:
        xp = xs.to(dtype)
    if not bf16:
        return xp.contiguous().numpy()
    lanes = xp.view(n_tok, width // 32, 2, 16).transpose(2, 3)  # lane L = 2 b + h holds input 16 h + b
    return lanes.reshape(n_tok, width).view(torch.int16).numpy()


def _scratch(shape: tuple[int, int]) -> Tensor:
    """An uninitialised float32 tensor that this thread's next call reuses (up to _SCRATCH_MAX_BYTES): a
    decode step runs ~200 adapted linears, and a fresh output each time is a fresh mmap to page in."""
    n = shape[0] * shape[1]
    if n * 4 > _SCRATCH_MAX_BYTES:
        return torch.empty(shape, dtype=torch.float32)
    buf = getattr(_scratch_local, "buf", None)
    if buf is None or buf.numel() < n:
        buf = _scratch_local.buf = torch.empty(max(n, 1 << 16), dtype=torch.float32)
    return buf[:n].view(shape)


def _cpu_delta(xs: Tensor, dest: np.ndarray, tok_start: np.ndarray, signs: list[Tensor], scales: list[Tensor],
               refs: list[float | None], *, n_out_rows: int, out_f: int, group_size: int) -> Tensor:
    """float32 (n_out_rows, out): row dest[t] = delta of token xs[t] (xs (n_tok, in), grouped by variant slot
    as tok_start says); rows no token names are 0."""
    n_tok, in_f = xs.shape
    nbytes = -(-in_f // 8)
    n_groups = scales[0].shape[1]
    group_bytes = nbytes if n_groups == 1 else group_size // 8
    sg = [s.contiguous() for s in signs]  # held until the kernel returns: it reads them by address
    sc = [(s if s.dtype in (torch.float32, torch.uint8) else s.float()).contiguous() for s in scales]
    xp = _kernel_x(xs, n_groups * group_bytes * 8, group_bytes)
    out = _scratch((n_out_rows, out_f))
    if n_tok < n_out_rows:  # rows of the base alone or of the tile path
        out.zero_()
    args = (xp, tok_start, dest, np.array([s.data_ptr() for s in sg], dtype=np.int64),
            np.array([c.data_ptr() for c in sc], dtype=np.int64),
            np.array([-1.0 if r is None else r for r in refs], dtype=np.float32), LOG8_MULT,
            np.array([c.shape[0] for c in sc], dtype=np.int64), out_f, nbytes, group_bytes)
    on = out.numpy()
    in_group_ranges(lambda i0, i1: kernels_cpu.delta_rows(*args, i0, i1, on),
                    kernels_cpu.n_items(len(sg), out_f), torch.get_num_threads())
    return out


@functools.lru_cache(maxsize=64)
def _route(variant_of_row: bytes, t_per_row: int) -> tuple:
    """How a batch's rows (int64 variant slots as bytes, -1 = base) reach the kernels, computed once per
    batch shape (every adapted linear of a forward asks): (used slots, and for the kernel: the slots it
    serves, their tokens' flat indices in variant order (numpy, and torch or None when that is all tokens in
    order), tok_start; for the tile path: [(slot, batch rows)])."""
    vr = np.frombuffer(variant_of_row, dtype=np.int64)
    sel = np.flatnonzero(vr >= 0)
    order = sel[np.argsort(vr[sel], kind="stable")]  # batch rows with a variant, grouped by variant
    used, counts = np.unique(vr[order], return_counts=True)
    fast = counts * t_per_row <= _KERNEL_MAX_TOKENS
    starts = np.concatenate([[0], np.cumsum(counts)])
    tiles = [(int(used[i]), torch.from_numpy(order[starts[i]:starts[i + 1]].copy()))
             for i in np.flatnonzero(~fast).tolist()]  # long prompts: unpacked tiles + torch matmul
    rows = order[np.repeat(fast, counts)]
    tokens = (rows[:, None] * t_per_row + np.arange(t_per_row)).reshape(-1)  # flat (B * T) indices
    tok_start = np.concatenate([[0], np.cumsum(counts[fast] * t_per_row)]).astype(np.int64)
    in_order = np.array_equal(tokens, np.arange(len(vr) * t_per_row))  # e.g. decode, one variant per row
    return used.tolist(), used[fast].tolist(), tokens, None if in_order else torch.from_numpy(tokens), tok_start, tiles


def bitdelta_linear(x: Tensor, weight: Tensor, bias: Tensor | None, signs: list[Tensor], scales: list[Tensor],
                    group_size: int, variant_of_row: Tensor, *, scale_refs: list[float] | None = None,
                    prechecked: bool = False) -> Tensor:
    """x (B, T, in), weight (out, in) -> (B, T, out); row b adds variant ``variant_of_row[b]``'s delta.

    ``signs[v]`` uint8 (out, ceil(in/8)) and ``scales[v]`` float32 (out or 1, n_groups) with groups of
    ``group_size`` inputs (a multiple of 8, or one group per row); ``variant_of_row`` int64 (B,), -1 for
    a row served by the base alone. With ``scale_refs``, ``scales[v]`` are uint8 log8 codes and
    ``scale_refs[v]`` their tensor's reference (see :func:`log8_scale_codes`). The delta is computed in
    float32 and added to the base output in float32, then rounded once to x's dtype. ``prechecked``: the
    caller vouches that every variant fits the weight with one group layout (PackedWeight checks itself).
    """
    y = torch.nn.functional.linear(x, weight, bias)  # (B, T, out)
    vr = variant_of_row.to("cpu", torch.long)
    if not (vr >= 0).any():
        return y
    out_f, in_f = weight.shape
    t_per_row = x[0].numel() // in_f  # tokens per batch row
    used, fast, tokens_np, tokens, tok_start, tiles = _route(vr.contiguous().numpy().tobytes(), t_per_row)
    refs = [scale_refs[v] if scale_refs else None for v in range(len(scales))]
    if not prechecked:
        _check_packed([signs[v] for v in used], [scales[v] for v in used], [refs[v] for v in used], out_f=out_f,
                      in_f=in_f, group_size=group_size)
    if x.is_cuda:
        from zoo_gym.serving.kernels_triton import triton_delta_add

        return triton_delta_add(y, x, signs, scales, group_size, vr, scale_refs=scale_refs)
    for v, rows in tiles:
        dv = _tile_delta(x.index_select(0, rows).to(torch.float32), signs[v], _scales_f32(scales[v], refs[v]),
                         out_f=out_f, in_f=in_f, group_size=group_size)
        y.index_add_(0, rows, dv.to(y.dtype))
    if fast:
        flat = x.reshape(-1, in_f)  # (B * T, in)
        xs = flat if tokens is None else flat.index_select(0, tokens)  # (n_tok, in) in variant order
        d = _cpu_delta(xs, tokens_np, tok_start, [signs[v] for v in fast], [scales[v] for v in fast],
                       [refs[v] for v in fast], n_out_rows=flat.shape[0], out_f=out_f, group_size=group_size)
        y.add_(d.view(y.shape))  # float32 sum, one rounding to y's dtype
    return y


def warm_up() -> None:
    """Compile (or load from numba's on-disk cache) the CPU kernels for float32 and bf16 inputs: the first call
    otherwise pays it (and the memory the compiled code takes shows up in the first mixed batch)."""
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.zeros(1, 1, 32, dtype=dtype)
        bitdelta_linear(x, torch.zeros(8, 32, dtype=dtype), None, [torch.zeros(8, 4, dtype=torch.uint8)],
                        [torch.ones(8, 1)], 32, torch.zeros(1, dtype=torch.long))
