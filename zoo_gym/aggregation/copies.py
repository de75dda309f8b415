"""Copies count once: run a coordinate-wise rule on one row per group of copies, then share each group's
diagnostics among its members.

The groups come from `krum.duplicate_groups` (rows within 1% of the rows' typical nearest-neighbour
distance, named by their first row). A group is its first row, weighted by the mean of its members'
weights, so k identities sending one row weigh what one sends; each member's `weight_used` is its share
of its group's (by weight; equal when unweighted) and it shares the group's `selected`, `score` and
`trimmed_share`. With no two rows grouped the rule runs on the rows as given: the same numbers.
Rules that take weights over all rows (the geometric median, centered clipping) get `split_weights`: each
member's weight divided by its group's size, so a group weighs the mean of its members' weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from .errors import AggregationError
from .result import AggregateResult, Diagnostics


def on_members(deltas: Tensor, groups: Tensor, weights: Tensor | None,
               rule: Callable[[Tensor, Tensor | None], AggregateResult]) -> AggregateResult:
    """`rule(rows, weights)` over one row per group of `deltas` (n, d); diagnostics back per member (n,)."""
    n = deltas.shape[0]
    group = torch.as_tensor(groups, dtype=torch.int64).flatten()
    if group.shape != (n,) or bool((group < 0).any()) or bool((group > torch.arange(n)).any()):
        raise AggregationError(f"`groups` must name each of the {n} rows' group by its first row (<= its "
                               f"own index), got {group.tolist()}")
    reps = torch.unique(group)  # sorted: the groups' first rows
    if reps.numel() == n:
        return rule(deltas, weights)
    pos = torch.searchsorted(reps, group)  # (n,) each row's group's position among reps
    raw = torch.ones(n, dtype=torch.float64) if weights is None else \
        torch.as_tensor(weights, dtype=torch.float64).flatten()
    total = torch.zeros(reps.numel(), dtype=torch.float64).index_add_(0, pos, raw)  # (groups,) members' sum
    sizes = torch.bincount(pos, minlength=reps.numel()).to(torch.float64)
    res = rule(deltas[reps], None if weights is None else total / sizes)  # a group: its members' mean weight
    member = torch.where(total[pos] > 0, raw / total[pos].clamp_min(1e-300), 0.0)  # share of its group's
    d = res.diagnostics
    return AggregateResult(aggregate=res.aggregate, diagnostics=Diagnostics(
        score=d.score[pos], selected=d.selected[pos], weight_used=d.weight_used[pos] * member,
        trimmed_share=d.trimmed_share[pos]))


def split_weights(weights: Tensor, groups: Tensor) -> Tensor:
    """(n,) float64 shares summing to 1: each row's weight divided by the size of its group of copies."""
    group = torch.as_tensor(groups, dtype=torch.int64).flatten()
    w = torch.as_tensor(weights, dtype=torch.float64).flatten()
    if group.shape != w.shape:
        raise AggregationError(f"`groups` has {group.numel()} rows, `weights` {w.numel()}")
    sizes = torch.bincount(group, minlength=w.numel()).to(torch.float64)[group]
    out = w / sizes
    return out / out.sum()
