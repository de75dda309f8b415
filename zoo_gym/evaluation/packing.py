"""``PackedScoringSet``: the exact loss (with or without a delta), the 0-1 loss (greedy exact match's
complement) and the base gradient of a scoring set packed by ``packed_batch.pack_shared_prefix``, the same
quantities as ``evaluate.Evaluator`` and ``gym_train.exact_match`` compute."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from .errors import EvaluationInputError
from .gradient import base_gradient
from .packed_batch import pack_shared_prefix, packed_loss_sum, packed_misses, supports_packing
from .streamed_model import computing

__all__ = ["PackedScoringSet", "pack_shared_prefix", "packed_loss_sum", "packed_misses", "supports_packing"]


class PackedScoringSet:
    """Exact mean completion loss of ``model`` (+ an optional delta) on packed examples.

    ``loss(delta, scale=c)`` evaluates with ``c * delta`` added to the weights, one module at a
    time (the weights themselves are never written), like ``evaluate.Evaluator.loss``; it equals
    that loss up to float rounding. ``gradient()`` is
    ``base_gradient`` on the same packed batch.
    """

    def __init__(self, model: torch.nn.Module, pairs: Sequence[tuple[Sequence[int], Sequence[int]]],
                 *, pad_id: int, row_tokens: int = 128) -> None:
        if not supports_packing(model):
            raise EvaluationInputError("packed scoring needs attention 'sdpa' or 'eager'; use "
                                    "gym_train.Evaluator (padded batches) for this model")
        self.model = model
        self.batch = pack_shared_prefix(pairs, pad_id=pad_id, row_tokens=row_tokens)
        self._params = dict(model.named_parameters(remove_duplicate=False))

    def loss(self, delta: Mapping[str, Tensor] | None = None, *, scale: float = 1.0) -> float:
        """Mean completion-token loss of base + ``scale * delta`` (weights restored after; `_with_delta`)."""
        total, count = self._with_delta(lambda: packed_loss_sum(self.model, self.batch), delta, scale)
        return float(total) / count

    def zero_one_loss(self, delta: Mapping[str, Tensor] | None = None, *, scale: float = 1.0) -> float:
        """Share of the examples whose greedy completion under base + ``scale * delta`` is not their reference
        (``packed_misses``: 1 - greedy exact match, from one forward pass). Always in float32, the base too: a
        bf16 base would flip near-tied answers that base + delta, computed in float32, does not."""
        return float(self.misses(delta, scale=scale).float().mean())

    def misses(self, delta: Mapping[str, Tensor] | None = None, *, scale: float = 1.0) -> Tensor:
        """(examples,) bool, in the pairs' order: which greedy completions are not their reference (float32)."""
        return self._with_delta(lambda: packed_misses(self.model, self.batch), delta, scale, float32=True)

    def _with_delta(self, compute, delta: Mapping[str, Tensor] | None, scale: float, *, float32: bool = False):
        """``compute()`` with ``scale * delta`` added to the weights, the original weights restored after.

        The delta is applied module by module, not to the whole model at once: a forward pre-hook on
        each module that owns a changed parameter swaps in ``p + scale * delta`` (the same float
        operation as adding in place) and its forward hook swaps the original tensor back. Only one
        changed weight exists beside the model at a time (at 0.6B, LoRA touches 1.8 GB of float32
        weights that a saved copy would hold), the original weights are never written, and a
        ``delta`` that computes its values on access (``delta[name]``) is read one tensor at a time.
        """
        delta = delta if delta is not None else {}
        patches: dict[int, tuple[str, torch.nn.Parameter]] = {}
        for name in delta.keys():
            p = self._params.get(name)
            if p is None:
                raise EvaluationInputError(f"delta names {name!r}, which is not a parameter "
                                        "of the model: score against the round's base")
            if id(p) in patches:
                raise EvaluationInputError(f"delta names the tied parameter {name!r} twice "
                                        "(under two aliases): send it once")
            patches[id(p)] = (name, p)
        owners: dict[torch.nn.Module, list[tuple[str, torch.nn.Parameter]]] = {}
        for module in self.model.modules():
            for p in module._parameters.values():  # noqa: SLF001 - parameters the module itself owns
                if p is not None and id(p) in patches:
                    owners.setdefault(module, []).append(patches[id(p)])
        applied: set[int] = set()
        swapped: dict[int, tuple[torch.nn.Parameter, Tensor]] = {}

        def changed(name: str, p: torch.nn.Parameter) -> Tensor:
            d = delta[name]
            if not isinstance(d, Tensor) or tuple(d.shape) != tuple(p.shape):
                shape = tuple(d.shape) if isinstance(d, Tensor) else type(d).__name__
                raise EvaluationInputError(f"delta {name!r} has shape {shape}, the model's "
                                        f"is {tuple(p.shape)}")
            applied.add(id(p))
            return torch.add(p.data, d.to(device=p.device, dtype=p.dtype), alpha=scale)

        def swap_in(module, _args):
            for name, p in owners[module]:
                if id(p) not in swapped:  # a tied weight owned twice by one module: once
                    new = changed(name, p)
                    swapped[id(p)] = (p, p.data)
                    p.data = new

        def swap_out(module, _args, _out):
            for _, p in owners[module]:
                if id(p) in swapped:
                    p.data = swapped.pop(id(p))[1]

        handles = []
        was_training = self.model.training
        self.model.eval()
        try:
            for module in owners:
                handles.append(module.register_forward_pre_hook(swap_in))
                handles.append(module.register_forward_hook(swap_out))
            # base + delta in float32 always: a delta's effect is below a bf16 weight's rounding
            upcast = computing(self.model, torch.float32) if delta or float32 else contextlib.nullcontext()
            with torch.no_grad(), upcast:
                out = compute()
            for name, p in patches.values():  # a parameter no module used still gets its check
                if id(p) not in applied:
                    changed(name, p)
            return out
        finally:
            for h in handles:
                h.remove()
            for p, orig in swapped.values():
                p.data = orig
            self.model.train(was_training)

    def gradient(self, *, spill_dir=None):
        """``BaseGradient`` of the mean completion loss at the current weights (on disk in ``spill_dir``
        when given: ``gradient.base_gradient``)."""
        return base_gradient(self.model, [self.batch], spill_dir=spill_dir)
