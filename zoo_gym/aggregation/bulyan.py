"""Bulyan (El Mhamdi et al. 2018, "The Hidden Vulnerability of Distributed Learning in
Byzantium", ICML; arXiv:1802.07927).

1. Selection: repeat Krum on the remaining set theta = n - 2f times, each time moving the
   winner into the selection set (recomputing scores on what remains; the n - f - 2 neighbour
   count shrinks with the set, floored at 1).
2. Per coordinate: among the theta selected values keep the beta = theta - 2f closest to their
   median and average them.
Needs n >= 4f + 3; smaller n is refused. Unlike Flower's Bulyan, the caller's list is never
mutated. `bulyan_select` works on a whole-model distance matrix so the pipeline selects once.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ._checks import check_deltas
from .distances import pairwise_sq_distances
from .errors import AggregationError, NotRobustConfigError
from .result import AggregateResult, make_diagnostics


def check_bulyan_config(*, n: int, f: int) -> None:
    """Refuse f < 0 and n < 4f + 3."""
    if f < 0:
        raise AggregationError(f"`f` (byzantine contributors) must be >= 0, got {f}")
    if n < 4 * f + 3:
        raise NotRobustConfigError(
            f"Bulyan with f={f} needs n >= 4f + 3 = {4 * f + 3} contributors, got n={n}; lower "
            f"--byzantine-f to at most {max((n - 3) // 4, 0)} or use multi-krum")


def bulyan_select(distances: Tensor, *, f: int) -> Tensor:
    """Indices (theta,) chosen by iterated Krum, in the order they were chosen."""
    dist = torch.as_tensor(distances, dtype=torch.float64)
    n = dist.shape[0]
    check_bulyan_config(n=n, f=f)
    remaining = list(range(n))
    chosen: list[int] = []
    for _ in range(n - 2 * f):
        sub = dist[remaining][:, remaining].clone()  # (r, r)
        sub.fill_diagonal_(float("inf"))
        nearest = max(1, len(remaining) - f - 2)
        scores = sub.sort(dim=1).values[:, :nearest].sum(dim=1)
        best = int(torch.sort(scores, stable=True).indices[0])
        chosen.append(remaining.pop(best))
    return torch.tensor(chosen, dtype=torch.int64)


def bulyan(deltas: Tensor, *, f: int, distances: Tensor | None = None) -> AggregateResult:
    """Bulyan aggregate of `deltas` (n, d) -> (d,)."""
    deltas = check_deltas(deltas)
    n, d = deltas.shape
    dist = pairwise_sq_distances(deltas) if distances is None else distances
    chosen = bulyan_select(dist, f=f)  # (theta,)
    theta = chosen.numel()
    beta = theta - 2 * f
    sel = deltas[chosen]  # (theta, d)
    values, order = sel.sort(dim=0, stable=True)
    lo, hi = (theta - 1) // 2, theta // 2
    med = (values[lo].double() + values[hi]) / 2  # (d,) float64: exact, cannot overflow
    closest = (sel - med).abs().topk(beta, dim=0, largest=False, sorted=False).indices  # (beta, d)
    acc = torch.zeros(d, dtype=torch.float64)  # (d,) float64 sum of the kept values
    for row in sel.gather(0, closest):
        acc += row
    agg = (acc / beta).to(deltas.dtype)
    used_local = torch.bincount(closest.flatten(), minlength=theta).to(torch.float64)
    used = torch.zeros(n, dtype=torch.float64)
    used[chosen] = used_local
    selected = torch.zeros(n, dtype=torch.bool)
    selected[chosen] = True
    del order
    return AggregateResult(
        aggregate=agg,
        diagnostics=make_diagnostics(n=n, selected=selected, weight_used=used / used.sum(),
                                     trimmed_share=1.0 - used / d),
    )
