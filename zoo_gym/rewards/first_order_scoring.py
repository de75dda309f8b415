"""Score a round from one gradient: first-order gains, the linear Shapley game, two safety checks.

Scores ``scoring.combine_scores`` from the base gradient ``g`` and one streamed pass over the deltas:
``slope_i = <g, c_i delta_i>``, gain ``g_i = -slope_i / L0`` (clamped, a gain above 1 counts as 1), and
phi_i the Shapley value of the linear game V(S) = sum_S w_i g_i / sum_S w_i (exact for n <= 6, else
2048 sampled permutations). Checks: a random-direction gate (``cos_i >= min_cosine_z / sqrt(d)``) and
an exact forward pass for the top ``verify_top_k``; a player failing either, or with a non-finite slope,
scores 0 and leaves the game. ``base_loss`` and ``exact_solo_loss`` must use the gradient's examples.
References: FLTrust (Cao, Fang, Liu, Gong, NDSS 2021); GTG-Shapley (Liu et al., ACM TIST 2022).
Why: docs/design/rewards-scoring.md.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .errors import ConfigError, ScoringInputError
from .first_order import linear_shapley
from .marginal import MarginalEstimate
from .scoring import DiagnosticsLike, RoundScoring, ScoringConfig, combine_scores


@dataclass(frozen=True)
class FirstOrderConfig:
    """First-order scoring knobs (the score formula's own knobs stay in `ScoringConfig`)."""

    permutations: int = 2048    # linear-game permutations (arithmetic; ~1 ms at n = 50)
    min_cosine_z: float = 4.0   # random-direction gate: cos(-g, delta) >= z / sqrt(d)
    verify_top_k: int = 2       # exact solo losses (forward passes) for the k highest scores
    verify_slack: float = 1.0   # fail iff exact gain < -verify_slack x first-order gain

    def __post_init__(self) -> None:
        if self.permutations < 1:
            raise ConfigError(f"`permutations` must be >= 1, got {self.permutations}")
        if not (math.isfinite(self.min_cosine_z) and self.min_cosine_z >= 0):
            raise ConfigError(f"`min_cosine_z` must be finite and >= 0, got {self.min_cosine_z}")
        if not (math.isfinite(self.verify_slack) and self.verify_slack >= 0):
            raise ConfigError(f"`verify_slack` must be finite and >= 0, got {self.verify_slack}")
        if self.verify_top_k < 0:
            raise ConfigError(f"`verify_top_k` must be >= 0, got {self.verify_top_k}")


def _check_inputs(contributors: Sequence[str], *, slopes, norms, weights, diagnostics,
                  base_loss: float, grad_norm: float, numel: int) -> None:
    n = len(contributors)
    for name, seq in (("slopes", slopes), ("norms", norms), ("weights", weights),
                      ("diagnostics", diagnostics)):
        if len(seq) != n:
            raise ScoringInputError(f"`{name}` has {len(seq)} entries for {n} contributors")
    if len(set(contributors)) != n:
        raise ScoringInputError("`contributors` holds duplicates; score one submission per "
                                "contributor per round")
    if not (math.isfinite(base_loss) and base_loss > 0):
        raise ScoringInputError(f"`base_loss` must be finite and > 0, got {base_loss!r}")
    if not (math.isfinite(grad_norm) and grad_norm >= 0) or numel < 1:
        raise ScoringInputError(f"`grad_norm` must be finite and >= 0 and `numel` >= 1, got "
                                f"{grad_norm!r} and {numel!r}")


def _random_direction_gate(players: list[int], *, gains: list[float], slopes: Sequence[float],
                           norms: Sequence[float], grad_norm: float, numel: int,
                           first_order: FirstOrderConfig) -> dict[int, str]:
    """{player: reason} for every player whose positive gain comes with a cosine below the gate."""
    zero: dict[int, str] = {}
    floor = first_order.min_cosine_z / math.sqrt(numel)
    for i in players:
        if gains[i] <= 0 or norms[i] <= 0:
            continue  # already 0 through g_i <= 0
        cos = -float(slopes[i]) / (grad_norm * float(norms[i])) if grad_norm > 0 else 0.0
        if cos < floor:
            zero[i] = (f"delta indistinguishable from a random direction: cosine with the "
                       f"validation descent direction {cos:.3g} < {floor:.3g} "
                       f"(= {first_order.min_cosine_z:g} / sqrt({numel}))")
    return zero


def score_round_first_order(
    contributors: Sequence[str], *, base_loss: float, grad_norm: float, numel: int,
    slopes: Sequence[float], norms: Sequence[float], weights: Sequence[float],
    diagnostics: Sequence[DiagnosticsLike], config: ScoringConfig,
    first_order: FirstOrderConfig = FirstOrderConfig(),
    exact_solo_loss: Callable[[int], float] | None = None,
    generator: torch.Generator | None = None,
) -> RoundScoring:
    """Score every submission from first-order slopes (module docstring).

    ``slopes[i] = <g, c_i delta_i>`` and ``norms[i] = ||c_i delta_i||`` (``first_order.streamed_slopes``),
    ``weights[i]`` the aggregation weight of the used part of ``delta_i`` (0 when not used),
    ``grad_norm = ||g||`` and ``numel = d`` (``BaseGradient.norm`` / ``.numel``). The answer's
    ``estimate.evaluations`` counts the exact forward passes spent on verification.
    """
    n = len(contributors)
    _check_inputs(contributors, slopes=slopes, norms=norms, weights=weights, diagnostics=diagnostics,
                  base_loss=base_loss, grad_norm=grad_norm, numel=numel)
    accepted = [bool(d.accepted) for d in diagnostics]
    players = [i for i in range(n) if accepted[i]]
    gains = [-float(s) / base_loss if math.isfinite(s) else -math.inf for s in slopes]

    zero = _random_direction_gate(players, gains=gains, slopes=slopes, norms=norms,
                                  grad_norm=grad_norm, numel=numel, first_order=first_order)

    gen = generator if generator is not None else torch.Generator().manual_seed(config.seed)
    start = gen.get_state()

    def solve() -> tuple[dict[int, float], int, bool]:
        """phi of the linear game over the players whose first-order gain is trusted."""
        gen.set_state(start)  # a re-solve draws the same permutations
        game = [i for i in players if i not in zero and math.isfinite(gains[i])]
        values, used, exact = linear_shapley([min(1.0, max(-1.0, gains[i])) for i in game],
                                             [max(float(weights[i]), 0.0) for i in game],
                                             permutations=first_order.permutations, generator=gen)
        phi = dict.fromkeys(players, 0.0)
        phi.update(zip(game, values))
        return phi, used, exact

    phi, used, exact = solve()
    method = "first_order_shapley" if not exact else "first_order_shapley_exact"
    estimate = MarginalEstimate(values=phi, method=method, evaluations=0, permutations=used)
    # A first-order gain above 1 predicts a negative loss: scored as 1, the most a loss can fall.
    capped = [min(g, 1.0) for g in gains]
    scores = combine_scores(contributors, capped, estimate, diagnostics, config, zero_reasons=zero)

    verified: list[int] = []
    refuted: list[int] = []
    if exact_solo_loss is not None and first_order.verify_top_k > 0:
        ranked = sorted((i for i in players if scores[i].score > 0),
                        key=lambda i: (-scores[i].score, contributors[i]))
        for i in ranked[: first_order.verify_top_k]:
            loss = float(exact_solo_loss(i))
            verified.append(i)
            exact_gain = (base_loss - loss) / base_loss if math.isfinite(loss) else -math.inf
            # A promise above 1 (a loss below 0) is outside the linear regime: then the exact
            # loss must actually fall. A slack growing with the promise would let a delta 1e30
            # away that "promises" a gain of 3e29 pass with any finite loss.
            if gains[i] <= 1.0:
                allowed = -first_order.verify_slack * gains[i]
                failed, bar = exact_gain < allowed, f"allowed down to {allowed:.3g}"
            else:
                failed, bar = exact_gain <= 0.0, "a promise above 1 must show a real gain"
            if failed:
                refuted.append(i)
                zero[i] = (f"exact check failed: base + delta has loss {loss:.6g} against base "
                           f"{base_loss:.6g} on the scoring set (gain {exact_gain:.3g}), "
                           f"first order promised gain {gains[i]:.3g}; {bar}")
        if refuted:  # a refuted promise is no evidence: the others' marginals without it
            phi, used, exact = solve()
            estimate = MarginalEstimate(values=phi, method=method, evaluations=0, permutations=used)
            scores = combine_scores(contributors, capped, estimate, diagnostics, config,
                                    zero_reasons=zero)
    note = (f"{used} {'(all)' if exact else 'sampled'} permutations of the linear game; "
            f"{len(verified)} exact solo checks; {len(zero)} zeroed by the checks")
    estimate = MarginalEstimate(values=phi, method=method, evaluations=len(verified),
                                permutations=used, note=note)
    return RoundScoring(scores=scores, estimate=estimate)
