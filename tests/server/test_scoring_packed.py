"""The server's scoring set on the tiny model: packed (shared prefix once, no padding) yet the same
loss and gradient as the padded evaluator, and the exact check, run on it, zeroes a delta whose
first-order gain is large but whose real loss rises (a curvature exploit: sharpened logits), while an
honest step passes and is paid the whole pool."""

from __future__ import annotations

import pytest
import torch

from zoo_gym.gym_train import Evaluator, default_validation_examples, tiny_model_dir
from zoo_gym.rewards import (ContributionDiagnostics, FirstOrderConfig, ScoringConfig,
                             SettlementConfig, base_gradient, directional_slopes,
                             plan_settlement, score_round_first_order)
from zoo_gym.evaluation.packing import PackedScoringSet
from zoo_gym.evaluation.server_evaluator import ServerEvaluator


@pytest.fixture(scope="module")
def server_eval():
    return ServerEvaluator(tiny_model_dir(), default_validation_examples(n=40), scoring_examples=32)


def test_scoring_set_is_packed_and_equals_the_padded_evaluator(server_eval):
    ev = server_eval
    assert isinstance(ev.scoring, PackedScoringSet) and ev.scoring.batch.examples == 32
    padded = Evaluator(None, ev.scoring_set, model=ev.base.model, tokenizer=ev.base.tokenizer)
    assert ev.scoring.loss(None) == pytest.approx(padded.loss(None), rel=1e-5)  # float32 sums in another order: ~1e-7 here, CPU-dependent
    g = ev.gradient()
    assert ev.gradient() is g  # once per base
    ref = base_gradient(padded.model, padded._batches)  # noqa: SLF001 (its padded batches)
    assert g.base_loss == pytest.approx(ref.base_loss, rel=1e-5)  # float32 sums in another order: ~1e-7 here, CPU-dependent
    # the server's gradient is spilled in bfloat16 (evaluation/spill.py): compare with the padded one rounded alike
    # (an element whose float32 sums differ across a rounding boundary moves by one bf16 step, 2^-8 of it: 1.2e-4
    # of the norm here, against 2e-3 for the rounding itself)
    num = sum(float((g.grad[k] - v.to(torch.bfloat16).float()).norm() ** 2) for k, v in ref.grad.items()) ** 0.5
    assert num <= 5e-4 * ref.norm
    assert g.norm == pytest.approx(ref.norm, rel=1e-5)  # summed from the float32 values, before the rounding


def test_exact_check_on_the_packed_set_zeroes_a_curvature_exploit(server_eval):
    ev = server_eval
    g = ev.gradient()
    unit = {k: -v / g.norm for k, v in g.grad.items() if k != "lm_head.weight"}  # tied alias once
    # Sharpen every logit (scale the final norm), orthogonal to g: no first-order effect at all.
    sharpen = {k: torch.zeros_like(v) for k, v in unit.items()}
    sharpen["model.norm.weight"] = torch.ones_like(sharpen["model.norm.weight"])
    dot = sum(float((sharpen[k] * unit[k]).sum()) for k in unit)
    sharpen = {k: sharpen[k] - dot * unit[k] for k in unit}
    step = {k: v * 0.25 for k, v in unit.items()}                          # honest: down the gradient
    exploit = {k: 0.5 * unit[k] + 5.0 * sharpen[k] for k in unit}          # 2x the promised gain
    zero = {k: torch.zeros_like(v) for k, v in unit.items()}
    deltas = [step, exploit, zero]
    # Preconditions: the step really helps; the exploit's loss rises by more than first order
    # promised it would fall (gain 0.5 |g| / L0), which is what the check must catch.
    assert ev.scoring.loss(step) < g.base_loss
    assert ev.scoring.loss(exploit) > g.base_loss + 0.5 * g.norm
    slopes = directional_slopes(g.grad, deltas)
    norms = [sum(float((v.double() ** 2).sum()) for v in d.values()) ** 0.5 for d in deltas]
    ids = ["step", "exploit", "zero"]
    checked: list[int] = []

    def exact(i: int) -> float:
        checked.append(i)
        return ev.scoring.loss(deltas[i])

    def score(exact_solo_loss):
        return score_round_first_order(
            ids, base_loss=g.base_loss, grad_norm=g.norm, numel=g.numel, slopes=slopes, norms=norms,
            weights=[1.0, 1.0, 0.0], diagnostics=[ContributionDiagnostics()] * 3,
            config=ScoringConfig(), first_order=FirstOrderConfig(verify_top_k=2),
            exact_solo_loss=exact_solo_loss)

    unchecked = score(None)
    assert unchecked.scores[1].score > unchecked.scores[0].score > 0  # first order alone pays it most
    res = score(exact)
    assert sorted(checked) == [0, 1]
    assert res.scores[1].score == 0.0 and "exact check failed" in res.scores[1].reason
    assert res.scores[0].score > 0 and res.scores[2].score == 0.0
    plan = plan_settlement(round_id=1, scores=res.scores, reputations={}, pool=1000,
                           config=SettlementConfig())
    paid = {p.contributor: p.amount for p in plan.payouts}
    assert paid.get("step") == 1000 and not paid.get("exploit") and not paid.get("zero")
