"""Input checks shared by the aggregators (typed errors naming the argument)."""

from __future__ import annotations

import torch
from torch import Tensor

from .errors import InvalidDeltaError


def check_deltas(deltas: Tensor, *, name: str = "deltas") -> Tensor:
    """Return `deltas` as a floating (n, d) tensor; refuse other shapes, empty or non-finite input."""
    if not isinstance(deltas, Tensor):
        raise InvalidDeltaError(f"`{name}` must be a torch.Tensor shaped (n, d), got {type(deltas)}")
    if deltas.dim() != 2:
        raise InvalidDeltaError(f"`{name}` must be shaped (n_contributors, n_params), got "
                                f"{tuple(deltas.shape)}; stack flattened deltas with torch.stack")
    if deltas.shape[0] == 0:
        raise InvalidDeltaError(f"`{name}` has no contributors (shape {tuple(deltas.shape)})")
    if not deltas.is_floating_point():
        raise InvalidDeltaError(f"`{name}` must be floating point, got {deltas.dtype}")
    if not bool(torch.isfinite(deltas).all()):
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


def combine(coefficients: Tensor, deltas: Tensor) -> Tensor:
    """`coefficients @ deltas` in the deltas' dtype: (n,) x (n, d) -> (d,)."""
    return coefficients.to(deltas.dtype) @ deltas
