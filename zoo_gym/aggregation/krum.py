"""Krum and Multi-Krum (Blanchard et al. 2017, "Machine Learning with Adversaries: Byzantine
Tolerant Gradient Descent", NeurIPS; arXiv:1703.02757).

Score of a row: the sum of squared distances to its n - f - 2 nearest OTHER rows (self excluded
by index). Krum returns the lowest-scoring row; Multi-Krum averages the m lowest-scoring ones
(default m = n - f) with server-given weights. Needs n >= 2f + 3; ties broken by index (stable).
Copies count once: rows closer than `DUPLICATE_SQ_DISTANCE` x the median nearest-neighbour squared
distance are one group, scored and chosen as one row whose weight its members split; each copy
beyond the first counts against f (against colluders sending one crafted row: ALIE, Baruch et al.
2019). Selection works on an (n, n) whole-model distance matrix, so a streamed round selects once.
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


DUPLICATE_SQ_DISTANCE = 1e-4  # copies: squared distance < this x the median nearest-neighbour one (1% apart)


def duplicate_groups(distances: Tensor) -> np.ndarray:
    """(n,) int64: each row's group, named by its first row; rows closer than DUPLICATE_SQ_DISTANCE x the
    median of the rows' nonzero squared distances to their nearest other row are one group (transitively)."""
    n = distances.shape[0]
    dist = _check_distances(distances, n=n)
    group = np.arange(n)
    if n < 2:
        return group
    nearest = np.where(np.eye(n, dtype=bool), np.inf, dist).min(axis=1)
    nearest = nearest[nearest > 0]  # the honest spread's scale: outliers are a minority; copies left out
    tol = DUPLICATE_SQ_DISTANCE * float(np.median(nearest)) if nearest.size else 0.0
    close = dist <= tol  # (n, n), the diagonal included
    for _ in range(n):  # label propagation: each row takes the smallest label among its close rows
        smaller = np.where(close, group[None, :], n).min(axis=1)
        if (smaller == group).all():
            break  # each connected component is labelled by its first row
        group = smaller
    return group


def _scores(distances: Tensor, *, f: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(per-row score: its group's, group of each row, f left after the copies counted against it)."""
    n = distances.shape[0]
    check_krum_config(n=n, f=f)
    dist = _check_distances(distances, n=n)
    group = duplicate_groups(distances)
    reps = np.unique(group)
    # n - groups copies counted against f keep groups >= 2 f_left + 3 whenever n >= 2f + 3 and f_left > 0
    f_left = max(f - (n - len(reps)), 0)
    d = dist[np.ix_(reps, reps)]
    np.fill_diagonal(d, np.inf)  # exclude self exactly
    d.sort(axis=1)
    rep_score = d[:, :max(len(reps) - f_left - 2, 0)].sum(axis=1)  # all copies of one row: no neighbours
    return rep_score[np.searchsorted(reps, group)], group, f_left


def krum_scores(distances: Tensor, *, f: int) -> Tensor:
    """(n,) float64 Krum scores from an (n, n) squared-distance matrix (copies share their group's)."""
    return torch.from_numpy(_scores(distances, f=f)[0])


def multi_krum_shares(distances: Tensor, *, f: int, m: int | None = None) -> Tensor:
    """(n,) float64: each row's share of one chosen row, 1 / its group's size if its group is among the m
    lowest-scoring groups (ties by first index), else 0. Default m: groups - f left."""
    return krum_selection(distances, f=f, m=m)[1]


def krum_selection(distances: Tensor, *, f: int, m: int | None = None) -> tuple[Tensor, Tensor]:
    """((n,) Krum scores, (n,) Multi-Krum shares as `multi_krum_shares`) from one scoring of the rows."""
    scores, group, f_left = _scores(distances, f=f)
    reps = np.unique(group)
    m = len(reps) - f_left if m is None else min(m, len(reps))
    if not 1 <= m:
        raise AggregationError(f"`m` (contributors to keep) must be >= 1, got {m}")
    chosen = reps[np.argsort(scores[reps], kind="stable")[:m]]
    sizes = np.bincount(group, minlength=len(group))
    shares = np.where(np.isin(group, chosen), 1.0 / sizes[group], 0.0)
    return torch.from_numpy(scores), torch.from_numpy(shares)


def multi_krum_coefficients(distances: Tensor, *, f: int, m: int | None,
                            weights: Tensor) -> tuple[Tensor, Tensor]:
    """((n,) Krum scores, (n,) float64 coefficients summing to 1): the chosen groups' shares times
    `weights` (n,), normalised; copies share one row's weight."""
    scores, shares = krum_selection(distances, f=f, m=m)
    coeff = shares * weights
    if float(coeff.sum()) <= 0:
        raise AggregationError("every selected contributor has weight 0")
    return scores, coeff / coeff.sum()


def multi_krum_select(distances: Tensor, *, f: int, m: int | None = None) -> Tensor:
    """Indices int64 of the rows in the m lowest-scoring groups (m rows when no two are copies), lowest
    score first (ties by index)."""
    n = distances.shape[0]
    if m is not None and not 1 <= m <= n:
        raise AggregationError(f"`m` (contributors to keep) must be in [1, {n}], got {m}")
    scores, shares = (t.numpy() for t in krum_selection(distances, f=f, m=m))
    rows = np.flatnonzero(shares > 0)
    return torch.from_numpy(rows[np.argsort(scores[rows], kind="stable")].astype(np.int64))


def krum_select(distances: Tensor, *, f: int) -> Tensor:
    """Index (1,) of the Krum choice."""
    return multi_krum_select(distances, f=f, m=1)


def multi_krum(deltas: Tensor, *, f: int, m: int | None = None, weights: Tensor | None = None,
               distances: Tensor | None = None) -> AggregateResult:
    """Average of the m best-scoring deltas (n, d) -> (d,). `distances` (n, n) overrides the
    distances computed from `deltas` (pass whole-model distances when streaming)."""
    deltas = check_deltas(deltas, finite=distances is not None)  # else: the distances check the values
    n = deltas.shape[0]
    dist = pairwise_sq_distances(deltas) if distances is None else distances
    if m is not None and not 1 <= m <= n:
        raise AggregationError(f"`m` (contributors to keep) must be in [1, {n}], got {m}")
    scores, coeff = multi_krum_coefficients(dist, f=f, m=m, weights=check_weights(weights, n=n))
    selected = coeff > 0
    return AggregateResult(
        aggregate=combine(coeff, deltas),
        diagnostics=make_diagnostics(n=n, score=scores, selected=selected, weight_used=coeff,
                                     trimmed_share=(~selected).to(torch.float64)),
    )


def krum(deltas: Tensor, *, f: int, distances: Tensor | None = None) -> AggregateResult:
    """The single best-scoring delta of `deltas` (n, d) -> (d,)."""
    return multi_krum(deltas, f=f, m=1, distances=distances)
