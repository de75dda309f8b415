"""The server's root gradient: loss and gradient of the validation loss at the base checkpoint.

First-order scoring (``first_order.py``) needs ``g = dL/dtheta`` at the round's base, where ``L`` is
the same mean completion-token cross-entropy that ``gym_train.Evaluator.loss`` computes (token-
weighted over the whole example set, labels ``-100`` outside completions). It depends only on the
base checkpoint and the validation set, never on the submissions, so the server can compute it
once when it publishes a base (while contributors train) and reuse it when it scores that round:
``BaseGradient`` is that cached value. FLTrust (Cao, Fang, Liu, Gong, NDSS 2021) calls the
corresponding update the server's root update.

Cost: one forward and one backward over the examples (about 3 forward passes); on the tiny model
with 32 examples, 1 CPU thread, about 0.1 s padded, about 0.07 s packed (``packing.py``: the shared
chat prefix computed once per row, no padding).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from .errors import ScoringInputError
from .packing import PackedBatch, packed_loss_sum


@dataclass(frozen=True)
class BaseGradient:
    """Validation loss ``L0`` and its gradient at a base checkpoint (float32, detached)."""

    base_loss: float               # L0, mean completion-token cross-entropy (nats per token)
    grad: dict[str, Tensor]        # parameter name -> dL/dtheta, the parameter's shape
    examples: int                  # validation examples it was computed on
    tokens: int                    # completion tokens the mean runs over

    @cached_property
    def norm(self) -> float:
        """``||g||_2`` over distinct parameters (tied aliases counted once; float64 accumulation)."""
        total = torch.zeros((), dtype=torch.float64)
        for g in self._unique():  # float64 a block at a time: no float64 copy of a whole embedding
            flat = g.reshape(-1)
            for i in range(0, flat.numel(), 1 << 20):
                total += (flat[i:i + (1 << 20)].double() ** 2).sum()
        return float(torch.sqrt(total))

    @cached_property
    def numel(self) -> int:
        """Number of distinct parameters ``d`` (tied aliases counted once)."""
        return sum(g.numel() for g in self._unique())

    @property
    def released(self) -> bool:
        """Whether the gradient tensors were freed (`release`): only the summary numbers remain."""
        return any(g.is_meta for g in self.grad.values())

    def release(self) -> "BaseGradient":
        """This gradient's loss, norm and size with the tensors freed.

        The tensors in ``grad`` are replaced in place by meta tensors of the same shapes (holders of
        the same dict, e.g. a ``SlopeTap``, still read the shapes); ``norm`` and ``numel`` are
        computed first and carried over."""
        norm, numel = self.norm, self.numel
        metas: dict[int, Tensor] = {}
        for k, g in list(self.grad.items()):
            metas.setdefault(id(g), torch.empty(g.shape, dtype=g.dtype, device="meta"))
            self.grad[k] = metas[id(g)]
        out = BaseGradient(base_loss=self.base_loss, grad=self.grad, examples=self.examples, tokens=self.tokens)
        out.__dict__["norm"], out.__dict__["numel"] = norm, numel  # cached_property values
        return out

    def _unique(self) -> list[Tensor]:
        seen: set[int] = set()
        out = []
        for g in self.grad.values():
            key = id(g) if g.is_meta else g.data_ptr()
            if key not in seen:
                seen.add(key)
                out.append(g)
        return out


def _loss_sum(model: torch.nn.Module, batch) -> tuple[Tensor, int, int]:
    """(summed completion cross-entropy, completion tokens, examples) of one batch."""
    if isinstance(batch, PackedBatch):
        loss, tokens = packed_loss_sum(model, batch)
        return loss, tokens, batch.examples
    ids, mask, labels = batch
    logits = model(input_ids=ids, attention_mask=mask).logits        # (B, T, V)
    shift_labels = labels[:, 1:]                                      # (B, T-1)
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.shape[-1]),        # (B*(T-1), V)
        shift_labels.reshape(-1), ignore_index=-100, reduction="sum")
    return loss, int((shift_labels != -100).sum()), int(ids.shape[0])


def base_gradient(model: torch.nn.Module,
                  batches: Iterable[tuple[Tensor, Tensor, Tensor] | PackedBatch]) -> BaseGradient:
    """Mean completion loss of ``model`` over ``batches`` and its gradient, in one backward.

    ``batches`` yields ``(input_ids, attention_mask, labels)``, each ``(B, T)``, labels ``-100``
    where no loss is taken (``gym_train.evaluate.collate`` makes them), or ``PackedBatch`` es
    (``packing.pack_shared_prefix``: the same loss on fewer positions). The model's parameters and
    their ``.grad`` are left as they were (``.grad`` is reset to None before and after).
    """
    # remove_duplicate=False: a tied weight (lm_head.weight = embed_tokens.weight) appears under
    # both names with the same gradient, so a delta naming either gets the right slope.
    params = dict(model.named_parameters(remove_duplicate=False))
    was_training = model.training
    model.eval()
    model.zero_grad(set_to_none=True)
    total: Tensor | None = None
    tokens = 0
    examples = 0
    try:
        with torch.enable_grad():
            for batch in batches:
                loss, k, b = _loss_sum(model, batch)
                total = loss if total is None else total + loss
                tokens += k
                examples += b
            if total is None or tokens == 0:
                raise ScoringInputError("`batches` hold no completion tokens (every label is -100 "
                                        "or there is no batch): nothing to take a gradient of")
            mean = total / tokens
            mean.backward()
        # The .grad tensors are taken over, not copied (a copy would be a second model-sized buffer at
        # once); zero_grad below detaches them from the parameters. One per distinct parameter.
        taken: dict[int, Tensor] = {}
        grad = {}
        for k, p in params.items():
            if id(p) not in taken:
                taken[id(p)] = (p.grad.detach() if p.grad is not None
                                else torch.zeros_like(p, requires_grad=False))
            grad[k] = taken[id(p)]
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return BaseGradient(base_loss=float(mean.detach()), grad=grad, examples=examples,
                        tokens=tokens)


def gradient_from_mapping(*, base_loss: float, grad: Mapping[str, Tensor], examples: int = 0,
                          tokens: int = 0) -> BaseGradient:
    """A `BaseGradient` from numbers computed elsewhere (tests, a GPU worker)."""
    return BaseGradient(base_loss=float(base_loss),
                        grad={k: v.detach().float() for k, v in grad.items()},
                        examples=examples, tokens=tokens)
