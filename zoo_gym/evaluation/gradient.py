"""The server's root gradient: loss and gradient of the validation loss at the base checkpoint.

``g = dL/dtheta`` at the round's base, ``L`` the mean completion-token cross-entropy that
``evaluate.Evaluator.loss`` computes (token-weighted, labels ``-100`` outside completions). It depends
only on the base and the validation set, so ``BaseGradient`` caches it from publish to scoring (FLTrust,
Cao, Fang, Liu, Gong, NDSS 2021: the server's root update). One forward and one backward over the
examples, decoder layers beyond the activation budget checkpointed (``activation_budget.py``); the
finished gradient can go to disk (``spill.py``). Costs: docs/design/rewards-scoring.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch
from torch import Tensor

from zoo_gym.evaluation.evaluate import head_loss_sum, scored_positions

from .activation_budget import checkpoint_beyond, decoder_layers
from .errors import EvaluationInputError
from .packed_batch import PackedBatch, packed_loss_sum
from .spill import SpilledTensors
from .streamed_model import stream_of
from .vocab_blocks import head_loss_sum as blocked_head_loss_sum
from .vocab_blocks import vocab_of


@dataclass(frozen=True)
class BaseGradient:
    """Validation loss ``L0`` and its gradient at a base checkpoint (float32, detached).

    ``grad`` is a dict, or a ``SpilledTensors`` whose tensors are read from disk one at a time
    (``base_gradient(spill_dir=...)``): the server's gradient is never resident as a whole."""

    base_loss: float               # L0, mean completion-token cross-entropy (nats per token)
    grad: Mapping[str, Tensor]     # parameter name -> dL/dtheta, the parameter's shape
    examples: int                  # validation examples it was computed on
    tokens: int                    # completion tokens the mean runs over

    @cached_property
    def norm(self) -> float:
        """``||g||_2`` over distinct parameters (tied aliases counted once; float64 accumulation)."""
        return float(torch.sqrt(sum((_sq_norm(g) for g in self._unique()), torch.zeros((), dtype=torch.float64))))

    @cached_property
    def numel(self) -> int:
        """Number of distinct parameters ``d`` (tied aliases counted once)."""
        return sum(g.numel() for g in self._unique())

    @property
    def released(self) -> bool:
        """Whether the gradient tensors were freed (`release`): only the summary numbers remain."""
        if isinstance(self.grad, SpilledTensors):
            return self.grad.closed
        return any(g.is_meta for g in self.grad.values())

    def release(self) -> "BaseGradient":
        """This gradient's loss, norm and size with the tensors freed.

        The tensors in ``grad`` are replaced in place by meta tensors of the same shapes (holders of
        the same mapping, e.g. a ``SlopeTap``, still read the shapes; a spilled gradient's file is
        deleted); ``norm`` and ``numel`` are computed first and carried over."""
        norm, numel = self.norm, self.numel
        if isinstance(self.grad, SpilledTensors):
            self.grad.close()
        else:
            metas: dict[int, Tensor] = {}
            for k, g in list(self.grad.items()):
                metas.setdefault(id(g), torch.empty(g.shape, dtype=g.dtype, device="meta"))
                self.grad[k] = metas[id(g)]
        return _with_summary(BaseGradient(base_loss=self.base_loss, grad=self.grad, examples=self.examples,
                                          tokens=self.tokens), norm=norm, numel=numel)

    def _unique(self) -> list[Tensor]:
        if isinstance(self.grad, SpilledTensors):
            return [self.grad[name] for name in self.grad.distinct()]
        seen: set[int] = set()
        out = []
        for g in self.grad.values():
            key = id(g) if g.is_meta else g.data_ptr()
            if key not in seen:
                seen.add(key)
                out.append(g)
        return out


def _with_summary(g: BaseGradient, *, norm: float, numel: int) -> BaseGradient:
    g.__dict__["norm"], g.__dict__["numel"] = norm, numel  # the cached_property values
    return g


def _sq_norm(g: Tensor) -> Tensor:
    """Squared L2 norm, float64 across rows of 16384 values whose norms are taken in float32 (relative
    error ~1e-7 at 155M values; one float32 pass over all of them drifts by percents, and a float64
    copy costs 40x the time)."""
    flat = g.detach().reshape(-1)
    rows = flat.numel() // _ROW
    x = flat[:rows * _ROW].view(rows, _ROW)
    if flat.dtype is torch.float32:
        total = (torch.linalg.vector_norm(x, dim=1).double() ** 2).sum()
    else:  # a bf16 gradient: upcast _BLOCK rows at a time into one small buffer, the same float32 row norms
        norms = torch.empty(rows)  # (a whole float32 copy: 13x the time, in fresh pages)
        buf = torch.empty(min(rows, _BLOCK), _ROW)
        for r in range(0, rows, _BLOCK):
            b = buf[:min(_BLOCK, rows - r)]
            b.copy_(x[r:r + len(b)])
            torch.linalg.vector_norm(b, dim=1, out=norms[r:r + len(b)])
        total = (norms.double() ** 2).sum()
    return total + (flat[rows * _ROW:].double() ** 2).sum()


_ROW = 1 << 14
_BLOCK = 64  # rows of _ROW upcast at a time (4 MB)


def _layer_bytes(model: torch.nn.Module) -> int:
    """One decoder layer's gradient as spilled (bf16): what may wait for the disk while the backward goes on
    (a layer's gradients come in one burst; at 4B queuing one layer took the pass from 31.7 s to 28.6 s)."""
    layers = decoder_layers(model)
    return 2 * sum(p.numel() for p in layers[0].parameters()) if layers else 16 << 20


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
    loss_sum = blocked_head_loss_sum if vocab_of(model) is not None else head_loss_sum
    return loss_sum(model, {"input_ids": ids.to(device), "attention_mask": mask.to(device)},
                         at=at, targets=targets)


def _backward_parts(batches, rows_per_backward: int | None) -> tuple[list, int, int]:
    """(parts with completion tokens, their tokens, their examples); refuses a set with no tokens."""
    parts = [p for batch in batches for p in _parts(batch, rows=rows_per_backward or (1 << 62))]
    parts = [p for p in parts if p[1] > 0]
    tokens = sum(k for _, k, _ in parts)
    examples = sum(b for _, _, b in parts)
    if tokens == 0:
        raise EvaluationInputError("`batches` hold no completion tokens (every label is -100 "
                                "or there is no batch): nothing to take a gradient of")
    return parts, tokens, examples


def _by_name(store: dict[int, Tensor] | SpilledTensors,
             params: dict[str, torch.nn.Parameter]) -> Mapping[str, Tensor]:
    """The gradients keyed by parameter name (tied names share one tensor); an unused parameter's is zeros."""
    if isinstance(store, SpilledTensors):
        for k, p in params.items():  # gradients are float32, also of a weight kept in bf16 (vocab_blocks.py)
            store.alias(k, id(p), p.shape, torch.promote_types(p.dtype, torch.float32))
        return store
    for p in params.values():
        if id(p) not in store:
            store[id(p)] = torch.zeros(p.shape, dtype=torch.promote_types(p.dtype, torch.float32),
                                       device=p.device)  # not zeros_like: streamed
    return {k: store[id(p)] for k, p in params.items()}


def _budget(model: torch.nn.Module, budget: int | None | str, *, streamed: bool) -> int | None:
    """Bytes of saved activations before layers are checkpointed: "auto" is a quarter of the parameters'
    bytes, or none for a streamed model (it checkpoints every layer itself)."""
    if budget != "auto":
        return budget
    return None if streamed else sum(p.numel() * p.element_size() for p in model.parameters()) // 4


class _GradientSink:
    """Where finished gradients go (a dict, or a SpilledTensors file), with ||g||^2 summed as they arrive."""

    def __init__(self, store: "dict[int, Tensor] | SpilledTensors") -> None:
        self.store = store
        self.sq = torch.zeros((), dtype=torch.float64)

    def take(self, p: torch.nn.Parameter) -> None:
        """A post-accumulate-grad hook: move p's finished gradient out of ``.grad``."""
        if p.grad is None:  # a vocabulary weight: its gradient comes through put_blocks
            return
        g = p.grad.detach()
        if g.is_sparse:  # a streamed model's untied input embedding (streamed_model.py)
            g = g.to_dense()
        self.sq = self.sq + _sq_norm(g)
        if isinstance(self.store, SpilledTensors):
            self.store.put(id(p), g)
        else:
            self.store[id(p)] = g
        p.grad = None

    def put_blocks(self, p: torch.nn.Parameter, blocks) -> None:
        """A vocabulary weight's gradient, a block of rows at a time (vocab_blocks.py)."""
        if isinstance(self.store, SpilledTensors):
            self.store.put_blocks(id(p), p.shape, self._summed(blocks))
        else:
            self.store[id(p)] = torch.cat(list(self._summed(blocks)))

    def _summed(self, blocks):
        for g in blocks:
            self.sq = self.sq + _sq_norm(g)
            yield g


def base_gradient(model: torch.nn.Module,
                  batches: Iterable[tuple[Tensor, Tensor, Tensor] | PackedBatch], *,
                  rows_per_backward: int | None = None, spill_dir: str | Path | None = None,
                  activation_budget: int | None | str = "auto") -> BaseGradient:
    """Mean completion loss of ``model`` over ``batches`` and its gradient.

    ``batches`` yields ``(input_ids, attention_mask, labels)``, each ``(B, T)``, labels ``-100``
    where no loss is taken (``evaluation.evaluate.collate`` makes them), or ``PackedBatch`` es
    (``packed_batch.pack_shared_prefix``: the same loss on fewer positions). The model's parameters and
    their ``.grad`` are left as they were (``.grad`` is reset to None before and after).

    One backward over everything by default (``rows_per_backward=None``). Each parameter's gradient
    is taken as soon as the last backward has finished it (a post-accumulate-grad hook), so the
    finished gradients never pile up in ``.grad``: with ``spill_dir`` they go straight to a
    ``SpilledTensors`` file there (nothing of the gradient stays resident), otherwise to a dict.
    Activations: decoder layers beyond ``activation_budget`` bytes of saved activations are
    checkpointed (``activation_budget.checkpoint_beyond``; "auto": a quarter of the parameters' bytes,
    None: keep everything). At Qwen3-0.6B's size the peak is then the model, a quarter of its size in
    activations and the output layer's gradient, instead of the model, its gradient and all activations.

    ``rows_per_backward`` splits a packed batch into parts of that many rows, each with its own
    forward and backward (parts before the last accumulate in ``.grad`` as usual): the same gradient
    up to the order of float additions, for sets too large for one pass.
    """
    # remove_duplicate=False: a tied weight (lm_head.weight = embed_tokens.weight) appears under
    # both names with the same gradient, so a delta naming either gets the right slope.
    if rows_per_backward is not None and rows_per_backward < 1:
        raise EvaluationInputError(f"`rows_per_backward` must be >= 1, got {rows_per_backward}")
    params = dict(model.named_parameters(remove_duplicate=False))
    parts, tokens, examples = _backward_parts(batches, rows_per_backward)
    stream = stream_of(model)
    activation_budget = _budget(model, activation_budget, streamed=stream is not None)
    sink = _GradientSink(SpilledTensors(spill_dir, queued_bytes=_layer_bytes(model)) if spill_dir is not None else {})

    was_training = model.training
    model.eval()
    model.zero_grad(set_to_none=True)
    total = 0.0  # summed cross-entropy, float64
    hooks = []
    vocab = vocab_of(model)
    try:
        with torch.enable_grad(), (vocab.gathering() if vocab is not None else contextlib.nullcontext()) as vg:
            for n, (part, _, _) in enumerate(parts):
                if n == len(parts) - 1:  # the last backward finishes every gradient: take each at once
                    hooks = [p.register_post_accumulate_grad_hook(sink.take)
                             for p in {id(p): p for p in params.values() if p.requires_grad}.values()]
                with checkpoint_beyond(model, activation_budget):
                    loss = _loss_sum(model, part)
                (loss / tokens).backward()
                total += float(loss.detach())
                del loss
            if vg is not None:  # the embedding's and output layer's gradients, a block of rows at a time
                vg.finish(vocab.head.weight, vocab.embed.weight, sink.put_blocks)
    except BaseException:
        if isinstance(sink.store, SpilledTensors):
            sink.store.close()
        raise
    finally:
        for h in hooks:
            h.remove()
        model.zero_grad(set_to_none=True)
        model.train(was_training)
        if stream is not None:
            stream.evict_all()
    grad = _by_name(sink.store, params)
    numel = sum(p.numel() for p in {id(p): p for p in params.values()}.values())
    return _with_summary(BaseGradient(base_loss=total / tokens, grad=grad, examples=examples, tokens=tokens),
                         norm=float(sink.sq.sqrt()), numel=numel)
