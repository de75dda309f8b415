"""Pass 1 of the round: per contributor finiteness and whole-delta L2 norm, and the refusals.

Norms come from the source's `sq_norms` when it vouches for them (e.g. LoRA factors' Gram
matrices, nothing decoded; never under DP, whose sensitivity is on the decoded rows), else from the
decoded rows. Refused, with a reason: non-finite, zero, above `max_delta_norm`, above
`max_norm_ratio` x the round's lower median norm (not under DP, where the clip bounds every delta).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .errors import InvalidDeltaError
from .streaming import row_blocks


@dataclass(frozen=True)
class Validated:
    """Pass 1's findings over the n contributions."""

    norms: Tensor                  # (n,) float64 whole-delta L2 norms (nan where non-finite)
    reasons: list[str | None]      # why each is refused (None: accepted)
    numels: dict[str, int]         # tensor name -> numel

    @property
    def accepted(self) -> Tensor:
        """int64 indices of the accepted contributions."""
        return torch.tensor([i for i, r in enumerate(self.reasons) if r is None], dtype=torch.int64)


def _sq_norms(source: Any, names: Sequence[str], n: int, *, private: bool
              ) -> tuple[Tensor, list[str | None], dict[str, int]]:
    """((n,) float64 squared norms over the finite rows, non-finite reasons, numels)."""
    sq = torch.zeros(n, dtype=torch.float64)
    reasons: list[str | None] = [None] * n
    numels: dict[str, int] = {}
    fast = None if private else getattr(source, "sq_norms", None)
    for name in names:
        known = fast(name) if fast is not None else None
        if known is not None:  # finite rows vouched for by the source, their norms without a decode
            sq_name, numels[name] = known
            if tuple(sq_name.shape) != (n,):
                raise InvalidDeltaError(f"DeltaSource.sq_norms({name!r}) must be shaped ({n},), "
                                        f"got {tuple(sq_name.shape)}")
            sq += sq_name.to(torch.float64)
            continue
        blocks = row_blocks(source, name, n)
        if blocks is None:
            numels[name] = _add_tensor(sq, reasons, source.stacked(name), name, n)
        else:  # too many rows to hold at once: a block of the tensor's rows at a time (streaming.py)
            numels[name] = sum(_add_tensor(sq, reasons, source.stacked_block(name, a, b), name, n) for a, b in blocks)
    return sq, reasons, numels


def _add_tensor(sq: Tensor, reasons: list[str | None], x: Tensor, name: str, n: int) -> int:
    """Add the squared norms of one tensor's rows `x` (n, numel) (or a block of them) to `sq`, naming non-finite
    rows in `reasons`; returns numel."""
    if x.dim() != 2 or x.shape[0] != n:
        raise InvalidDeltaError(f"DeltaSource.stacked({name!r}) must be shaped ({n}, numel), "
                                f"got {tuple(x.shape)}")
    # (n,) float64: a float32 square cannot overflow float64, so the norm is non-finite
    # exactly when the row is; only then is the row scanned for NaN/inf
    sq_x = torch.linalg.vector_norm(x, dim=1, dtype=torch.float64) ** 2
    finite = torch.isfinite(sq_x)
    if not bool(finite.all()):
        finite = torch.isfinite(x).all(dim=1)  # (n,)
        for i in (~finite).nonzero().flatten().tolist():
            if reasons[i] is None:
                reasons[i] = f"non-finite values (NaN or inf) in tensor {name!r}"
        sq_x = torch.linalg.vector_norm(torch.nan_to_num(x), dim=1, dtype=torch.float64) ** 2
    sq += torch.where(finite, sq_x, torch.zeros_like(sq))
    return x.shape[1]


def validate(source: Any, names: Sequence[str], n: int, *, max_delta_norm: float | None,
             max_norm_ratio: float | None, private: bool) -> Validated:
    """Pass 1 over the source's n contributions (`private`: under DP, see the module)."""
    sq, reasons, numels = _sq_norms(source, names, n, private=private)
    norms = sq.sqrt()
    for i in range(n):
        if reasons[i] is not None:
            norms[i] = float("nan")
        elif norms[i] == 0:
            reasons[i] = "zero delta: nothing to contribute (free rider)"
        elif max_delta_norm is not None and norms[i] > max_delta_norm:
            reasons[i] = (f"delta L2 norm {float(norms[i]):.4g} exceeds max_delta_norm "
                          f"{max_delta_norm:.4g}")
    usable = [float(v) for v in norms if math.isfinite(v) and v > 0]
    if max_norm_ratio is not None and usable and not private:
        # Not under DP: a refusal that depends on the other contributors' norms would change the
        # one-user sensitivity the noise assumes.
        ref = statistics.median_low(usable)
        for i in range(n):
            if reasons[i] is None and norms[i] > max_norm_ratio * ref:
                reasons[i] = (f"delta L2 norm {float(norms[i]):.4g} exceeds max_norm_ratio "
                              f"{max_norm_ratio:g} x the round's median delta norm {ref:.4g} "
                              f"(= {max_norm_ratio * ref:.4g})")
    return Validated(norms=norms, reasons=reasons, numels=numels)
