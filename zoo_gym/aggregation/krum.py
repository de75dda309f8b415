"""Krum and Multi-Krum (Blanchard et al. 2017, "Machine Learning with Adversaries: Byzantine
Tolerant Gradient Descent", NeurIPS; arXiv:1703.02757).

Score of contributor i: the sum of squared distances to its n - f - 2 nearest OTHER
contributors (self excluded by index, not by assuming it sorts first). Krum returns the
lowest-scoring delta; Multi-Krum averages the m lowest-scoring ones (default m = n - f), with
server-given weights if any (never self-reported sample counts). The guarantee needs
n >= 2f + 3, so n <= 2f + 2 is refused. Ties are broken by contributor index (stable).

Selection is separate from aggregation: `krum_scores` / `multi_krum_select` work on an (n, n)
whole-model distance matrix (summed over tensors while streaming), and the per-tensor call
reuses that one selection through `distances=`.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ._checks import check_deltas, check_weights, combine
from .distances import pairwise_sq_distances
from .errors import AggregationError, NotRobustConfigError
from .result import AggregateResult, make_diagnostics


def check_krum_config(*, n: int, f: int, rule: str = "Krum") -> None:
    """Refuse f < 0 and n <= 2f + 2 (Krum's guarantee needs n >= 2f + 3)."""
    if f < 0:
        raise AggregationError(f"`f` (byzantine contributors) must be >= 0, got {f}")
    if n <= 2 * f + 2:
        raise NotRobustConfigError(
            f"{rule} with f={f} needs n >= 2f + 3 = {2 * f + 3} contributors, got n={n}; "
            f"lower --byzantine-f to at most {max((n - 3) // 2, 0)} or wait for more contributors")


def _check_distances(distances: Tensor, *, n: int) -> np.ndarray:
    """A float64 numpy copy of an (n, n) distance matrix (small: numpy's per-call cost is a
    fraction of torch's, which matters on small models where selection is a large share)."""
    dist = np.array(torch.as_tensor(distances, dtype=torch.float64).numpy(), dtype=np.float64)
    if dist.shape != (n, n):
        raise AggregationError(f"`distances` must be ({n}, {n}), got {tuple(dist.shape)}")
    if not np.isfinite(dist).all() or (dist < 0).any():
        raise AggregationError("`distances` must be finite and >= 0")
    return dist


def _scores(distances: Tensor, *, f: int) -> np.ndarray:
    n = distances.shape[0]
    check_krum_config(n=n, f=f)
    dist = _check_distances(distances, n=n)
    np.fill_diagonal(dist, np.inf)  # exclude self exactly
    dist.sort(axis=1)
    return dist[:, :n - f - 2].sum(axis=1)


def krum_scores(distances: Tensor, *, f: int) -> Tensor:
    """(n,) float64 Krum scores from an (n, n) squared-distance matrix."""
    return torch.from_numpy(_scores(distances, f=f))


def multi_krum_select(distances: Tensor, *, f: int, m: int | None = None) -> Tensor:
    """Indices (m,) int64 of the m lowest Krum scores, lowest first (ties by index)."""
    n = distances.shape[0]
    m = n - f if m is None else m
    if not 1 <= m <= n:
        raise AggregationError(f"`m` (contributors to keep) must be in [1, {n}], got {m}")
    order = np.argsort(_scores(distances, f=f), kind="stable")[:m]
    return torch.from_numpy(order.astype(np.int64))


def krum_select(distances: Tensor, *, f: int) -> Tensor:
    """Index (1,) of the Krum choice."""
    return multi_krum_select(distances, f=f, m=1)


def multi_krum(deltas: Tensor, *, f: int, m: int | None = None, weights: Tensor | None = None,
               distances: Tensor | None = None) -> AggregateResult:
    """Average of the m best-scoring deltas (n, d) -> (d,). `distances` (n, n) overrides the
    distances computed from `deltas` (pass whole-model distances when streaming)."""
    deltas = check_deltas(deltas)
    n = deltas.shape[0]
    dist = pairwise_sq_distances(deltas) if distances is None else distances
    scores = krum_scores(dist, f=f)
    chosen = multi_krum_select(dist, f=f, m=m)
    w_all = check_weights(weights, n=n)
    coeff = torch.zeros(n, dtype=torch.float64)
    coeff[chosen] = w_all[chosen]
    if float(coeff.sum()) <= 0:
        raise AggregationError("every selected contributor has weight 0")
    coeff /= coeff.sum()
    selected = torch.zeros(n, dtype=torch.bool)
    selected[chosen] = True
    return AggregateResult(
        aggregate=combine(coeff, deltas),
        diagnostics=make_diagnostics(n=n, score=scores, selected=selected, weight_used=coeff,
                                     trimmed_share=(~selected).to(torch.float64)),
    )


def krum(deltas: Tensor, *, f: int, distances: Tensor | None = None) -> AggregateResult:
    """The single best-scoring delta of `deltas` (n, d) -> (d,)."""
    return multi_krum(deltas, f=f, m=1, distances=distances)
