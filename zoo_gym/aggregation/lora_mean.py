"""The weighted mean of LoRA deltas straight from their factors: sum_i c_i B_i A_i = [c_1 B_1 .. c_k B_k] @ [A_1; ..; A_k].

Through decoded rows, a tensor's mean costs k dense (out, in) float32 matrices written and read back (k
matmuls of rank r, then a float64 pass over the rows). With the factors concatenated it is one matmul of
rank k r writing one matrix. At Qwen3-0.6B's size with two contributors (benchmarks/publish_profile.py)
that was the larger part of a publish's arithmetic.

Used for the plain mean outside DP only: DP's clip and noise are defined on the decoded rows, and robust
rules need the rows themselves. The numbers are float32 sums over the k r products instead of the
float64 sum of float32-rounded rows: they agree to float32 rounding (~1e-7 relative).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from ._checks import weighted_terms


def factored_mean(source, name: str, acc: Tensor, clip: Tensor, coeff: Tensor, *,
                  total: float | None, out: Tensor | None = None) -> Tensor | None:
    """(numel,) float32 sum_j coeff_j clip_j x_j / total over the accepted rows (`acc` indexes the
    source's contributors), from `source.factors(name)`, written into `out` ((numel,) float32) when given;
    None when the source has no factors for it (then the caller decodes rows)."""
    get = getattr(source, "factors", None)
    factors: Sequence | None = get(name) if get is not None else None
    if factors is None:
        return None
    terms, denom = weighted_terms(coeff, total=total)
    bs, as_ = [], []
    for j, wj in terms:
        f = factors[int(acc[j])]
        if f is None:  # this contributor left the tensor unchanged: a zero row
            continue
        bs.append(f.B.float() * (wj * float(clip[j]) / denom))  # (out, r)
        as_.append(f.A.float())  # (r, in)
    shape = tuple(source.shape(name))
    if not bs:
        return torch.zeros(math.prod(shape)) if out is None else out.zero_()
    b, a = torch.cat(bs, dim=1), torch.cat(as_, dim=0)  # (o, k r), (k r, i)
    if out is None:
        return (b @ a).reshape(-1)
    torch.matmul(b, a, out=out.view(b.shape[0], a.shape[1]))
    return out
