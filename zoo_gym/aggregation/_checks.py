"""Input checks shared by the aggregators (typed errors naming the argument)."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from . import dense_kernels
from .errors import InvalidDeltaError
from .packed_kernels import in_group_ranges


def check_deltas(deltas: Tensor, *, name: str = "deltas", finite: bool = True) -> Tensor:
    """Return `deltas` as a floating (n, d) tensor; refuse other shapes, empty or (`finite`, a pass over
    the data) non-finite input. `finite=False` only where the caller detects NaN / inf itself."""
    if not isinstance(deltas, Tensor):
        raise InvalidDeltaError(f"`{name}` must be a torch.Tensor shaped (n, d), got {type(deltas)}")
    if deltas.dim() != 2:
        raise InvalidDeltaError(f"`{name}` must be shaped (n_contributors, n_params), got "
                                f"{tuple(deltas.shape)}; stack flattened deltas with torch.stack")
    if deltas.shape[0] == 0:
        raise InvalidDeltaError(f"`{name}` has no contributors (shape {tuple(deltas.shape)})")
    if not deltas.is_floating_point():
        raise InvalidDeltaError(f"`{name}` must be floating point, got {deltas.dtype}")
    if finite and not bool(torch.isfinite(deltas).all()):
        bad = (~torch.isfinite(deltas)).any(dim=1).nonzero().flatten().tolist()
        raise InvalidDeltaError(f"`{name}` rows {bad} contain NaN or inf; refuse those "
                                "contributions before aggregating")
    return deltas


def check_weights(weights: Tensor | None, *, n: int) -> Tensor:
    """Normalised float64 weights (n,) summing to 1; uniform when `weights` is None.

    Weights must come from the server (e.g. reputation), never from a contributor's own
    claim such as a sample count: a claim can be inflated at will.
    """
    if weights is None:
        return torch.full((n,), 1.0 / n, dtype=torch.float64)
    w = torch.as_tensor(weights, dtype=torch.float64).flatten()
    if w.shape != (n,):
        raise InvalidDeltaError(f"`weights` must have one entry per contributor ({n}), got "
                                f"{tuple(w.shape)}")
    if not bool(torch.isfinite(w).all()) or bool((w < 0).any()):
        raise InvalidDeltaError(f"`weights` must be finite and >= 0, got {w.tolist()}")
    total = float(w.sum())
    if total <= 0.0:
        raise InvalidDeltaError("`weights` sum to 0; give at least one contributor a positive weight")
    return w / total


# columns combined at a time by `combine`: its float64 buffers (8 MiB each) are reused
_COMBINE_CHUNK = 1 << 20
_MIN_TERMS_PER_THREAD = 1 << 20  # row-columns summed: below this a thread costs more than it saves


def weighted_terms(weights: Tensor, *, total: float | None) -> tuple[list[tuple[int, float]], float]:
    """([(row, weight)] of the rows with w_i != 0, divisor) that `combine64` uses: equal weights (every
    row with w_i > 0 weighs the same) are a plain sum divided by their count, so the uniform mean never
    goes through a rounded 1/n; otherwise sum_i w_i x_i / total (`total` defaults to sum_i w_i)."""
    w = torch.as_tensor(weights, dtype=torch.float64).flatten()  # (n,)
    used = w[w != 0]
    rows = w.nonzero().flatten().tolist()
    if total is None and used.numel() > 0 and bool((used == used[0]).all()):
        return [(i, 1.0) for i in rows], float(used.numel())
    return [(i, float(w[i])) for i in rows], float(w.sum()) if total is None else float(total)


def _accumulate(out: Tensor, terms: list[tuple[int, float]], deltas: Tensor, *,
                scratch: Tensor | None = None) -> Tensor:
    """out (zeros, float64) += sum_i w_i x_i over `terms`, row by row in float64: a fixed order of
    exact-width float64 additions (no BLAS call), the same result on every CPU, BLAS and thread count."""
    for i, wi in terms:
        if wi == 1.0:
            out += deltas[i]  # promoted to float64 element by element
        else:  # a separate rounded product, never fused into an FMA (which some CPUs lack)
            prod = deltas[i].to(torch.float64) if scratch is None else scratch.copy_(deltas[i])
            out += prod.mul_(wi)
    return out


def weighted_sum(weights: Tensor, deltas: Tensor) -> Tensor:
    """(d,) float64 sum_i w_i x_i of `deltas` (n, d), accumulated row by row in float64.

    A fixed order of exact-width float64 additions (no BLAS call): the same result on every CPU,
    BLAS and thread count. Rows of weight 0 are skipped. Extra memory: two (d,) float64 vectors.
    """
    w = torch.as_tensor(weights, dtype=torch.float64).flatten()  # (n,)
    terms = [(i, float(w[i])) for i in w.nonzero().flatten().tolist()]
    return _accumulate(torch.zeros(deltas.shape[1], dtype=torch.float64), terms, deltas)


def combine64(weights: Tensor, deltas: Tensor, *, total: float | None = None) -> Tensor:
    """(d,) float64 sum_i w_i x_i / total (`total` defaults to sum_i w_i): one division.

    Equal weights (every row with w_i > 0 weighs the same) are a plain float64 sum of those rows
    divided by their count, so the uniform mean never goes through a rounded 1/n.
    """
    terms, denom = weighted_terms(weights, total=total)
    return _accumulate(torch.zeros(deltas.shape[1], dtype=torch.float64), terms, deltas) / denom


def combine(weights: Tensor, deltas: Tensor, *, total: float | None = None) -> Tensor:
    """(d,) sum_i w_i x_i / total in the deltas' dtype: (n,) x (n, d) -> (d,).

    Accumulated in float64 and divided once (`combine64`), then cast once to the deltas' dtype,
    so a uniform mean of float32 deltas is the float64 sum / n rounded to float32: exact up to
    float64's resolution on every CPU (a float32 matmul is off by float32 rounding that depends
    on the BLAS and the instruction set). `combine64(...).to(dtype)`'s very numbers, computed
    `_COMBINE_CHUNK` columns at a time through reused float64 buffers instead of (d,) float64
    vectors (at a 0.6B model that was most of the aggregation's time: memory traffic and page faults).
    """
    terms, denom = weighted_terms(weights, total=total)
    d = deltas.shape[1]
    out = torch.empty(d, dtype=deltas.dtype)
    if len(terms) == 1 and terms[0][1] == 1.0 and denom == 1.0:  # one row as is (Krum): x in float64 / 1
        return deltas[terms[0][0]].detach().clone()
    if deltas.dtype in (torch.float32, torch.float64) and deltas.device.type == "cpu" and terms:
        x = deltas.detach()
        x = x if x.stride(1) == 1 else x.contiguous()
        xs, o = x.numpy(), out.numpy()
        rows = np.array([i for i, _ in terms], dtype=np.int64)
        ws = np.array([wi for _, wi in terms], dtype=np.float64)
        threads = min(torch.get_num_threads(), len(terms) * d // _MIN_TERMS_PER_THREAD)
        in_group_ranges(lambda c0, c1: dense_kernels.weighted_rows(xs, rows, ws, denom, c0, c1, o), d, threads)
        return out
    acc = torch.empty(min(d, _COMBINE_CHUNK), dtype=torch.float64)
    scratch = torch.empty_like(acc) if any(wi != 1.0 for _, wi in terms) else None
    for lo in range(0, d, _COMBINE_CHUNK):
        hi = min(d, lo + _COMBINE_CHUNK)
        a = acc[:hi - lo].zero_()
        _accumulate(a, terms, deltas[:, lo:hi], scratch=None if scratch is None else scratch[:hi - lo])
        out[lo:hi] = a.div_(denom)
    return out
