"""``PreferenceScoringSet``: the scoring loss when the validation data holds preference pairs.

The loss is the pairs' Bradley-Terry loss ``mean(-log sigmoid(m))``, ``m`` = log p(chosen) - log p(rejected)
(``evaluation.preference_eval``): positive, differentiable, and lower when the margins rise, so the
unchanged scoring formulas (relative gain ``(L0 - L_i) / L0``, first-order slopes ``<g, delta>``, the
random-direction gate, the exact checks) pay a delta that raises the margin and nothing to one that
lowers it. Same interface as ``PackedScoringSet``: ``loss(delta, scale=c)`` and ``gradient()``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
from torch import Tensor

from zoo_gym.evaluation.preference_eval import PreferenceEvaluator, completion_logprobs

from .errors import EvaluationInputError
from .gradient import BaseGradient
from .spill import SpilledTensors
from .vocab_blocks import vocab_of

__all__ = ["PreferenceScoringSet", "preference_loss"]


def preference_loss(margins: Tensor) -> Tensor:
    """Mean Bradley-Terry loss ``-log sigmoid(m)`` of per-pair margins (``softplus(-m)``, stable)."""
    return torch.nn.functional.softplus(-margins.float()).mean()


class PreferenceScoringSet:
    """Bradley-Terry loss (and its gradient) of ``model`` (+ an optional delta) on fixed pairs."""

    def __init__(self, model: torch.nn.Module, tokenizer, pairs: list[dict]) -> None:
        self.model = model
        self.evaluator = PreferenceEvaluator(None, pairs, model=model, tokenizer=tokenizer)

    def loss(self, delta: Mapping[str, Tensor] | None = None, *, scale: float = 1.0) -> float:
        """Bradley-Terry loss of base + ``scale * delta`` (weights restored after)."""
        return float(preference_loss(self.evaluator.margins(delta, scale=scale)))

    def gradient(self, *, spill_dir=None) -> BaseGradient:
        """``BaseGradient`` of the Bradley-Terry loss at the current weights (one forward and backward over
        the pairs; on disk in ``spill_dir`` when given). ``tokens`` and ``examples`` count pairs."""
        model = self.model
        params = dict(model.named_parameters(remove_duplicate=False))
        device = next(model.parameters()).device
        was_training = model.training
        model.eval()
        model.zero_grad(set_to_none=True)
        vocab = vocab_of(model)  # a streamed model's embedding / output layer: their gradient comes in blocks
        try:
            with torch.enable_grad(), (vocab.gathering() if vocab is not None else contextlib.nullcontext()) as vg:
                lp = completion_logprobs(model, self.evaluator._batches, device=device)  # noqa: SLF001
                loss = preference_loss(lp[0::2] - lp[1::2])
                if not loss.requires_grad:
                    raise EvaluationInputError("the preference loss does not depend on the model's weights")
                loss.backward()
                grads = {id(p): (p.grad.detach().clone() if p.grad is not None
                                 else torch.zeros(p.shape, dtype=torch.promote_types(p.dtype, torch.float32)))
                         for p in params.values()}
                if vg is not None:
                    vg.finish(vocab.head.weight, vocab.embed.weight,
                              lambda p, blocks: grads.__setitem__(id(p), torch.cat(list(blocks))))
        finally:
            model.zero_grad(set_to_none=True)
            model.train(was_training)
        if spill_dir is not None:
            store = SpilledTensors(spill_dir)
            for key, g in grads.items():
                store.put(key, g)
            for name, p in params.items():
                store.alias(name, id(p), p.shape, grads[id(p)].dtype)
            grad: Mapping[str, Tensor] = store
        else:
            grad = {name: grads[id(p)] for name, p in params.items()}
        return BaseGradient(base_loss=float(loss.detach()), grad=grad, examples=self.evaluator.n,
                            tokens=self.evaluator.n)  # norm and numel: computed from `grad` when asked

    def report(self, delta: Mapping[str, Tensor] | None = None, *, scale: float = 1.0) -> dict:
        return self.evaluator.report(delta, scale=scale)
