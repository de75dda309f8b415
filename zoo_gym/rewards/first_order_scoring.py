"""Score a round from one gradient: first-order gains, the linear Shapley game, two safety checks.

Exact scoring (``scoring.score_round``) costs ``1 + n + (marginal evaluations)`` forward passes over
the validation set: about 20x the round's aggregation on the tiny model at n = 10. This module
scores the same formula (``scoring.combine_scores``) from the base gradient ``g`` (``gradient.py``,
computable before the round's submissions arrive) and one streamed pass over the deltas:

    slope_i = <g, c_i delta_i>               (c_i: the aggregator's clip factor)
    g_i     = -slope_i / L0                  linearised solo gain, L_i ~= L0 + slope_i
    phi_i   = Shapley value of V(S) = sum_S w_i g_i / sum_S w_i (w_i: the aggregation weight of
              the part of delta_i the aggregator used), all permutations for n <= 6, else 2048
              sampled ones: arithmetic only, no truncation, so every player is measured (GTG-
              Shapley with a forward-pass budget truncates, and with fewer permutations than
              players leaves most of them at phi = 0 -- a lottery at n = 50).

First order ignores curvature and cannot tell a tiny aligned step from noise, so two checks:

1. random-direction gate: ``cos_i = -slope_i / (||g|| ||c_i delta_i||)`` must be at least
   ``min_cosine_z / sqrt(d)``. A direction drawn independently of ``g`` has ``cos ~ N(0, 1/d)``, so
   with z = 4 a random delta passes with probability 3e-5; an honest fine-tune of the tiny model
   measures cos 0.02-0.9 (the gate is 0.0044 at d = 836k). Fails -> score 0, reason given.
2. exact check of the top ``verify_top_k`` by provisional score (the ones the pool would pay
   most): ``exact_solo_loss(i)`` is one forward pass of base + c_i delta_i on the scoring set,
   exact gain ``e_i = (L0 - L_i) / L0``. It fails when ``e_i < -verify_slack * g_i``: the loss
   rose by more than first order promised it would fall (an overshooting step, a curvature
   exploit); the score is 0 and the reason says so. The slack (default 1) is there because 32
   examples are noisy: on the tiny model the std of an honest delta's gain over disjoint
   32-example sets is ~0.8x the gain and its sign flips in ~20 % of them (benchmarks/rewards.py,
   "noise"), so "e_i > 0" alone would zero honest contributors by chance. Passing keeps the
   first-order gain, so verified and unverified contributors are measured on the same scale.
   A promise g_i > 1 (a negative loss: outside the linear regime) must show e_i > 0 instead;
   otherwise a huge delta's huge promise would buy a huge slack.

Someone else's delta cannot zero an honest contributor (issue 12 item 5: a delta 1e30 away
"promised" a gain of 3e29, so every honest marginal in the mean game came out near -1.5e29):
* a gain above 1 predicts a negative loss: it enters the score as 1 (the most a cross-entropy
  can fall), and the game's inputs are the gains clamped to [-1, 1] (a doubled loss counted as
  the worst), so one player moves another's phi by a bounded amount;
* players whose first-order gain is not evidence -- gated as random, refuted by the exact check,
  or with a non-finite slope -- are left out of the game, and after a refutation the game is
  solved again (same permutations) without them.

Guarantees kept: a zero delta has slope 0 -> g = 0 -> score 0; a sign-flip of an honest step
has slope > 0 -> score 0; a random delta fails the gate; pools are split by the same
``settle`` code. ``base_loss`` and ``exact_solo_loss`` must use the same examples as the
gradient (the scoring set). Reference: FLTrust (Cao, Fang, Liu, Gong, NDSS 2021) for the server
root gradient; GTG-Shapley (Liu et al., ACM TIST 2022) for the game.
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
    accepted = [bool(d.accepted) for d in diagnostics]
    players = [i for i in range(n) if accepted[i]]
    gains = [-float(s) / base_loss if math.isfinite(s) else -math.inf for s in slopes]

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
