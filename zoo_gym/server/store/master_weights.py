"""The float32 master of a checkpoint stored below float32, kept as what the published tensors lack.

The master is a safetensors blob (the lineage's `master_sha256`) holding, tensor by tensor:
`I16`, the low half of a bf16 tensor's float32 master (the published bits widened plus the low half are
the master: `split_low16` / `join_low16`); `F32`, the master itself (float16 tensors, and every tensor
of a master in the all-float32 layout, read the same way); absent, the published tensor widened exactly
(a float32 tensor, or one no round has changed since genesis). The one difference int16 cannot hold,
+32768 (a tie rounded down to even), is kept one float32 unit (2^-24 relative) below the tie, which
rounds to the same published value. Design: docs/design/checkpoint-publishing.md.
"""

from __future__ import annotations

import sys

import torch
from torch import Tensor

_LOW = 0 if sys.byteorder == "little" else 1  # which int16 of a float32's two holds its low bits


def split_low16(master: Tensor) -> tuple[Tensor, Tensor]:
    """A float32 tensor -> (bf16 rounded to nearest, int16 low half) with join_low16(...) == master
    (one float32 unit below where the master is an exact tie that rounded down).

    The stored difference is the master's own low 16 bits read as a signed number: where rounding went
    down (low bits < 0x8000) it is exactly master - published, and where it went up (> 0x8000) the
    sign reading subtracts the 0x10000 that rounding added. Only an exact tie (0x8000, read as -32768)
    needs care: that reading is right when the tie rounded up (an odd high half to the even one above);
    when it rounded down (the high half was even) the difference is +32768, which int16 cannot hold, and
    32767 is stored: the one float32 unit. Three passes over the tensor, no 32-bit arithmetic."""
    flat = master.detach().reshape(-1)
    if flat.dtype != torch.float32:
        raise TypeError(f"the master is float32, not {flat.dtype}")
    published = flat.to(torch.bfloat16)  # round to nearest, ties to even
    low = flat.view(torch.int16)[_LOW::2].clone()  # (numel,) the low halves (little-endian order)
    ties = (low == -32768).nonzero().flatten()
    if ties.numel():  # rare (1 in 65536 random values): rounded down iff the high half did not change
        high = flat.view(torch.int16)[1 - _LOW::2][ties]
        down = high == published.view(torch.int16)[ties]
        low[ties[down]] = 32767
    return published.view(master.shape), low.view(master.shape)


def join_low16(published: Tensor, low: Tensor) -> Tensor:
    """The float32 master of a bf16 tensor from its published value and stored low half."""
    if published.dtype != torch.bfloat16 or low.dtype != torch.int16 or published.shape != low.shape:
        raise ValueError(f"a low half joins a bf16 tensor of its shape: got {published.dtype} "
                         f"{tuple(published.shape)} and {low.dtype} {tuple(low.shape)}")
    bits = (published.reshape(-1).view(torch.int16).to(torch.int32) << 16).add_(low.reshape(-1))
    return bits.view(torch.float32).view(published.shape)


def entry_dtype(dtype: torch.dtype) -> str | None:
    """What the master file stores for a changed tensor of `dtype` (None: the published tensor is its master)."""
    if dtype == torch.bfloat16:
        return "I16"
    if dtype.is_floating_point and dtype.itemsize < 4:
        return "F32"
    return None


def master_of(published: Tensor, master, name: str) -> Tensor:
    """Tensor `name`'s float32 master (a fresh tensor): `master` is a SafetensorsReader of the master
    file (None: no master kept yet), `published` the checkpoint's tensor."""
    info = master.infos.get(name) if master is not None else None
    if info is None:
        return published.float() if published.dtype != torch.float32 else published.clone()
    stored = master.read(name)
    if info.dtype == "I16":
        return join_low16(published, stored)
    return stored.float()


def needs_master(infos) -> bool:
    """Whether a checkpoint (its SafetensorsReader `infos`) stores floating weights below float32."""
    return any(entry_dtype(i.torch_dtype) is not None for i in infos.values())
