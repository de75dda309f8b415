"""First-order (linearised) losses: score a round from one gradient instead of n + k forward passes.

With ``g`` the gradient of the validation loss at the base checkpoint (one forward + backward),
to first order

    L_i  ~= L0 + <g, delta_i>                                   (solo loss, ``slope_i = <g, delta_i>``)
    L(S) ~= L0 + sum_{i in S} w_i slope_i / sum_{i in S} w_i    (the aggregator's weights w, restricted)

so every loss `score_round` needs costs one dot product per contributor, and the GTG-Shapley game
is free to evaluate. This is FLTrust's idea (Cao et al., NDSS 2021: trust = alignment with a
server "root" update computed on the server's own data) stated as a loss change: a random delta is
almost orthogonal to ``g`` in high dimension (|cos| ~ 1/sqrt(d)), so its score is tiny and falls under
the minimum quality; a sign-flip has ``slope > 0`` (loss up) and scores 0; a zero delta scores 0.
What it misses: curvature. A large delta that overshoots looks good to first order; keep the
server's norm bound / DP clipping on, or use exact losses when forward passes are affordable.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from .errors import ScoringInputError


def directional_slopes(grad: Mapping[str, Tensor],
                       deltas: Sequence[Mapping[str, Tensor]]) -> list[float]:
    """``<g, delta_i>`` for every delta (float64 accumulation); tensors missing from a delta count 0."""
    out = []
    for i, d in enumerate(deltas):
        total = torch.zeros((), dtype=torch.float64)
        for name, t in d.items():
            g = grad.get(name)
            if g is None:
                raise ScoringInputError(f"delta {i} has tensor {name!r} that the gradient lacks")
            if g.numel() != t.numel():
                raise ScoringInputError(f"delta {i} tensor {name!r} has {t.numel()} values, the "
                                        f"gradient {g.numel()}")
            total += torch.dot(g.reshape(-1).to(torch.float64), t.reshape(-1).to(torch.float64))
        out.append(float(total))
    return out


def linear_losses(*, base_loss: float, slopes: Sequence[float], weights: Sequence[float]
                  ) -> tuple[list[float], Callable[[frozenset[int]], float]]:
    """(solo_losses, subset_loss) of the linearised game, ready for `score_round`."""
    if len(slopes) != len(weights):
        raise ScoringInputError(f"`slopes` ({len(slopes)}) and `weights` ({len(weights)}) must "
                                "have the same length")
    solo = [base_loss + float(s) for s in slopes]

    def subset_loss(subset: frozenset[int]) -> float:
        tw = sum(float(weights[i]) for i in subset)
        if tw <= 0:
            return base_loss
        return base_loss + sum(float(weights[i]) * float(slopes[i]) for i in subset) / tw

    return solo, subset_loss
