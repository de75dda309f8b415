"""Distances to affine combinations of the inputs, from the pairwise distance matrix alone.

For v = sum_j a_j x_j with sum_j a_j = 1 and D_ij = ||x_i - x_j||^2:
    ||v - x_i||^2 = (D a)_i - 1/2 a^T D a.
Weiszfeld (geometric median) and centered clipping only ever form such combinations, so both
run on the (n, n) whole-model distance matrix and return coefficients a (n,); each tensor is
then aggregated as a @ X. This keeps streaming exact: no pass over the model per iteration.
"""

from __future__ import annotations

import torch
from torch import Tensor


def sq_dist_to_combination(distances: Tensor, coefficients: Tensor) -> Tensor:
    """(n,) float64 squared distances from each input to sum_j a_j x_j (sum a = 1)."""
    da = distances @ coefficients  # (n,)
    return (da - 0.5 * (coefficients @ da)).clamp(min=0.0)
