"""LoRA factors as a delta value.

Hu et al., "LoRA: Low-Rank Adaptation of Large Language Models" (ICLR 2022, arXiv:2106.09685).
A rank-r delta of a Linear weight is ``B @ A``; sending A and B costs ``r * (in + out)`` numbers
instead of ``in * out``, and is exact, where a 1-bit sign code of the merged matrix is not (a rank-8
LoRA's merged delta under a sign code has relative L2 error about 0.68 on the tiny model).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from zoo_gym.codec.errors import CodecError

__all__ = ["LoraFactors"]


@dataclass(frozen=True)
class LoraFactors:
    """A LoRA delta of one Linear weight, the LoRA scaling already folded into ``B``."""

    A: Tensor  # (r, in_features)
    B: Tensor  # (out_features, r)

    def __post_init__(self) -> None:
        if not isinstance(self.A, Tensor) or not isinstance(self.B, Tensor):
            raise CodecError("LoraFactors `A` and `B` must be tensors")
        if self.A.dim() != 2 or self.B.dim() != 2:
            raise CodecError(
                f"LoraFactors `A` must be (r, in) and `B` (out, r); got A {tuple(self.A.shape)}, B {tuple(self.B.shape)}"
            )
        if self.A.shape[0] != self.B.shape[1] or self.A.shape[0] == 0:
            raise CodecError(
                f"LoraFactors rank mismatch: A {tuple(self.A.shape)} has r={self.A.shape[0]}, "
                f"B {tuple(self.B.shape)} has r={self.B.shape[1]} (r must be equal and > 0)"
            )
        if self.A.dtype != self.B.dtype:
            raise CodecError(f"LoraFactors `A` ({self.A.dtype}) and `B` ({self.B.dtype}) must share one dtype")

    @property
    def rank(self) -> int:
        return self.A.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        """(out_features, in_features) of the merged delta."""
        return self.B.shape[0], self.A.shape[1]

    @property
    def dtype(self) -> torch.dtype:
        return self.A.dtype

    def merged(self, *, out: Tensor | None = None) -> Tensor:
        """(out, in) = B @ A, computed in float32; into `out` (a float32 (out, in) tensor, e.g. a row of a
        preallocated stack) when given, with the same numbers."""
        b, a = self.B.detach().cpu().float(), self.A.detach().cpu().float()
        if out is None:
            return b @ a
        return torch.matmul(b, a, out=out)

    def merged_sq_norm(self) -> float | None:
        """||B @ A||_F^2 from the (r, r) Gram matrices, sum((B^T B) * (A A^T)) in float64, without
        forming the (out, in) product; None when that is not safe, and then the caller decodes:

        * the float32 product `merged()` could overflow (non-finite factors, or the Cauchy-Schwarz
          bound max_i |B_i| max_j |A_:j| of every product element reaches 1e38; float32 ends at 3.4e38);
        * cancellation: the Gram sum is an expansion (STYLE 18). Its float64 rounding error is at most
          about (in + out + r) x 2^-53 x sum(|B^T B| * |A A^T|); refusing unless the result is above
          1e-3 x that sum bounds the relative error by ~1e-9 (a crafted B @ A ~ 0 from huge factors
          is decoded instead).

        It is the norm of the exact product: `merged()` rounds each element to float32, so the two
        differ by about r x 2^-24 relative (1e-7, a few ulps), far below any norm bound's meaning.
        """
        a = self.A.detach().cpu().double()  # (r, in)
        b = self.B.detach().cpu().double()  # (out, r)
        if not (bool(torch.isfinite(a).all()) and bool(torch.isfinite(b).all())):
            return None
        bound = float(torch.linalg.vector_norm(b, dim=1).max()) * float(torch.linalg.vector_norm(a, dim=0).max())
        if not bound < 1e38:
            return None
        gb, ga = b.T @ b, a @ a.T  # (r, r) each
        sq = float((gb * ga).sum())
        scale = float((gb.abs() * ga.abs()).sum())
        if not (math.isfinite(sq) and sq > 1e-3 * scale):
            return None if scale > 0 else 0.0
        return sq
