"""The server's root gradient: loss and gradient of the validation loss at the base checkpoint.

First-order scoring (``first_order.py``) needs ``g = dL/dtheta`` at the round's base, where ``L`` is
the same mean completion-token cross-entropy that ``gym_train.Evaluator.loss`` computes (token-
weighted over the whole example set, labels ``-100`` outside completions). It depends only on the
base checkpoint and the validation set, never on the submissions, so the server can compute it
once when it publishes a base (while contributors train) and reuse it when it scores that round:
``BaseGradient`` is that cached value. FLTrust (Cao, Fang, Liu, Gong, NDSS 2021) calls the
corresponding update the server's root update.

Cost: one forward and one backward over the examples (about 3 forward passes), a few packed rows
at a time (memory: the gradient plus one part's activations; the output layer only at scored
positions); on the tiny model
with 32 examples, 1 CPU thread, about 0.1 s padded, about 0.07 s packed (``packing.py``: the shared
chat prefix computed once per row, no padding).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property

import torch
from torch import Tensor

from zoo_gym.gym_train.evaluate import head_loss_sum, scored_positions

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


def _parts(batch, *, rows: int):
    """``(part, completion tokens, examples)``: a packed batch split into groups of ``rows`` rows
    (each part's backward holds the activations of its rows only); padded batches whole."""
    if isinstance(batch, PackedBatch):
        R = int(batch.input_ids.shape[0])
        for i, r0 in enumerate(range(0, R, rows)):
            part = batch.rows(r0, r0 + rows)
            yield part, part.tokens, batch.examples if i == 0 else 0
        return
    ids, _, labels = batch
    yield batch, int((labels[:, 1:] != -100).sum()), int(ids.shape[0])


def _loss_sum(model: torch.nn.Module, batch) -> Tensor:
    """Summed completion cross-entropy of one batch (the lm_head only at scored positions)."""
    if isinstance(batch, PackedBatch):
        return packed_loss_sum(model, batch)[0]
    ids, mask, labels = batch
    device = next(model.parameters()).device
    at, targets = scored_positions(labels.to(device))
    return head_loss_sum(model, {"input_ids": ids.to(device), "attention_mask": mask.to(device)},
                         at=at, targets=targets)


def base_gradient(model: torch.nn.Module,
                  batches: Iterable[tuple[Tensor, Tensor, Tensor] | PackedBatch], *,
                  rows_per_backward: int = 1) -> BaseGradient:
    """Mean completion loss of ``model`` over ``batches`` and its gradient.

    ``batches`` yields ``(input_ids, attention_mask, labels)``, each ``(B, T)``, labels ``-100``
    where no loss is taken (``gym_train.evaluate.collate`` makes them), or ``PackedBatch`` es
    (``packing.pack_shared_prefix``: the same loss on fewer positions). The model's parameters and
    their ``.grad`` are left as they were (``.grad`` is reset to None before and after).

    Memory: the gradient (1x the parameters, in the ``.grad`` tensors, taken over without a copy)
    plus one part's activations. The mean is ``sum_parts loss_part / tokens``, so each part
    (``rows_per_backward`` packed rows, or one padded batch) runs its own forward and backward into
    the accumulating ``.grad``: the same gradient as one backward over everything, up to the order
    of float additions, with the activations of one part alive at a time instead of all.
    """
    # remove_duplicate=False: a tied weight (lm_head.weight = embed_tokens.weight) appears under
    # both names with the same gradient, so a delta naming either gets the right slope.
    if rows_per_backward < 1:
        raise ScoringInputError(f"`rows_per_backward` must be >= 1, got {rows_per_backward}")
    params = dict(model.named_parameters(remove_duplicate=False))
    parts = [p for batch in batches for p in _parts(batch, rows=rows_per_backward)]
    tokens = sum(k for _, k, _ in parts)
    examples = sum(b for _, _, b in parts)
    if tokens == 0:
        raise ScoringInputError("`batches` hold no completion tokens (every label is -100 "
                                "or there is no batch): nothing to take a gradient of")
    was_training = model.training
    model.eval()
    model.zero_grad(set_to_none=True)
    total = 0.0  # summed cross-entropy, float64
    try:
        with torch.enable_grad():
            for part, k, _ in parts:
                if k == 0:
                    continue
                loss = _loss_sum(model, part)
                (loss / tokens).backward()
                total += float(loss.detach())
                del loss
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
    return BaseGradient(base_loss=total / tokens, grad=grad, examples=examples, tokens=tokens)


def gradient_from_mapping(*, base_loss: float, grad: Mapping[str, Tensor], examples: int = 0,
                          tokens: int = 0) -> BaseGradient:
    """A `BaseGradient` from numbers computed elsewhere (tests, a GPU worker)."""
    return BaseGradient(base_loss=float(base_loss),
                        grad={k: v.detach().float() for k, v in grad.items()},
                        examples=examples, tokens=tokens)
