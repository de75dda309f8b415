"""One compiled pass per tensor for a bf16 checkpoint's publish: join the master, add the aggregate, split.

Bit for bit the torch definition of `master_weights.py` (`join_low16`, float32 addition, round to
nearest even with NaN as the quiet NaN 0x7FC0, the tie rule of `split_low16`; tests/server/
test_master_kernel.py compares them), reading each bf16 value, low half and aggregate value once and
writing the new bf16 value and low half in place. The numba loop releases the GIL and takes a range, so
a tensor's two halves run on two threads (`packed_kernels.in_group_ranges`); compiled code is cached on
disk (`cache=True`) and `warm_up()` loads it at server start. Why by hand: docs/design/checkpoint-publishing.md.
"""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import njit, types
from numba.extending import intrinsic

from zoo_gym.aggregation.packed_kernels import in_group_ranges

__all__ = ["add_to_bf16_master", "warm_up"]

_MIN_PARALLEL = 1 << 18  # elements below which one thread does the whole tensor


@intrinsic
def _f32_of_bits(typingctx, bits):
    """The float32 whose bit pattern is the uint32 `bits`."""
    if bits != types.uint32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return types.float32(types.uint32), codegen


@intrinsic
def _bits_of_f32(typingctx, value):
    """The uint32 bit pattern of the float32 `value`."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.IntType(32))

    return types.uint32(types.float32), codegen


@njit(nogil=True, cache=True)
def _update(published, low, agg, has_low):
    """For every i: master = bits(published[i]) << 16 + low[i] (low 0 when not has_low) as float32,
    master += agg[i]; published[i], low[i] = the new master rounded to bf16 and its low half (int16).

    Branch free in 32-bit integers over whole (sliced) arrays, so LLVM vectorises it; a loop over
    range(i0, i1) of the full arrays does not vectorise (numba's index wraparound for a possibly negative i)."""
    for i in range(published.shape[0]):
        lo = np.uint32(np.int32(low[i])) if has_low else np.uint32(0)
        hi = np.uint32(np.uint32(np.uint16(published[i])) << np.uint32(16))
        master = _f32_of_bits(np.uint32(hi + lo)) + agg[i]  # uint32 addition wraps: a negative low half borrows
        b = _bits_of_f32(master)
        top = np.uint32(b >> np.uint32(16))
        up = np.uint32(np.uint32(b + np.uint32(0x7FFF) + (top & np.uint32(1))) >> np.uint32(16))  # round to nearest, ties to even
        lo16 = np.uint32(b & np.uint32(0xFFFF))
        lo16 = np.uint32(lo16 - np.uint32((lo16 == np.uint32(0x8000)) & (up == top)))  # a tie rounded down: one float32 unit below
        nan = master != master  # torch rounds NaN to the quiet NaN 0x7FC0; its low half means nothing
        published[i] = np.int16(np.uint32(0x7FC0) if nan else up)  # int16() keeps the low 16 bits
        low[i] = np.int16(np.uint32(0) if nan else lo16)


def add_to_bf16_master(published: torch.Tensor, low: torch.Tensor | None, agg: torch.Tensor,
                       *, threads: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(new published bf16, new low half int16) of `published` (bf16) + `low` (its stored low half, None:
    the master is `published` widened) + `agg` (float32, same numel): `split_low16(join_low16(published,
    low) + agg)` bit for bit. `published` and `low` must be fresh buffers: they are overwritten and returned."""
    if published.dtype != torch.bfloat16 or agg.dtype != torch.float32 or agg.numel() != published.numel():
        raise ValueError(f"a bf16 master update takes a bf16 tensor and a float32 aggregate of its size: got "
                         f"{published.dtype} {tuple(published.shape)} and {agg.dtype} {tuple(agg.shape)}")
    has_low = low is not None
    if low is None:
        low = torch.empty(published.shape, dtype=torch.int16)
    elif low.dtype != torch.int16 or low.shape != published.shape:
        raise ValueError(f"a low half is int16 of its tensor's shape: got {low.dtype} {tuple(low.shape)}")
    p = published.reshape(-1).view(torch.int16).numpy()
    lo = low.reshape(-1).numpy()
    a = agg.detach().reshape(-1).contiguous().numpy()
    n = p.shape[0]
    threads = (torch.get_num_threads() if threads is None else threads) if n >= _MIN_PARALLEL else 1
    in_group_ranges(lambda i0, i1: _update(p[i0:i1], lo[i0:i1], a[i0:i1], has_low), n, threads)
    return published, low


def warm_up() -> None:
    """Compile (or load from the on-disk cache) the kernel."""
    p = np.zeros(1, dtype=np.int16)
    _update(p, np.zeros(1, dtype=np.int16), np.zeros(1, dtype=np.float32), True)
