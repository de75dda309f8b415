"""Summed cross-entropy of a linear output layer, chunked over positions in forward and backward.

``linear_cross_entropy_sum`` applies the output layer (the lm_head) only at the given positions, a chunk
at a time, as one autograd function: its backward recomputes each chunk's logits and adds that chunk's
weight gradient into one buffer in place (``addmm_``). The same gradient as chunk-by-chunk autograd up
to float rounding, with one weight-sized buffer. Used by ``evaluate.head_loss_sum``.
Why: docs/design/training.md.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _chunk_logits(h: Tensor, weight: Tensor, bias: Tensor | None, cap: float | None) -> Tensor:
    logits = torch.nn.functional.linear(h, weight, bias).float()   # (k, V)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


class _LinearCrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                step: int, cap: float | None) -> Tensor:
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for i in range(0, hidden.shape[0], step):
            logits = _chunk_logits(hidden[i:i + step], weight, bias, cap)
            total += torch.nn.functional.cross_entropy(logits, targets[i:i + step], reduction="sum")
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.step, ctx.cap = step, cap
        return total

    @staticmethod
    def backward(ctx, grad_total: Tensor):
        hidden, weight, bias, targets = ctx.saved_tensors
        step, cap = ctx.step, ctx.cap
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2]
        grad_h = torch.empty_like(hidden) if need_h else None
        grad_w = torch.zeros_like(weight) if need_w else None
        grad_b = torch.zeros_like(bias) if need_b and bias is not None else None
        for i in range(0, hidden.shape[0], step):
            h = hidden[i:i + step]
            logits = _chunk_logits(h, weight, bias, cap)                 # (k, V) float32
            d = torch.softmax(logits, dim=-1)                             # d loss / d logits ...
            d[torch.arange(d.shape[0], device=d.device), targets[i:i + step]] -= 1.0
            d *= grad_total
            if cap:  # through tanh(z / cap) * cap: times 1 - tanh^2
                d *= 1.0 - (logits / cap) ** 2
            d = d.to(weight.dtype)
            if need_h:
                grad_h[i:i + step] = d @ weight
            if need_w:
                grad_w.addmm_(d.t(), h)                                   # in place: one buffer
            if grad_b is not None:
                grad_b += d.sum(0)
            del logits, d
        return grad_h, grad_w, grad_b, None, None, None


def linear_cross_entropy_sum(hidden: Tensor, head: torch.nn.Linear, targets: Tensor, *, step: int,
                             cap: float | None = None) -> Tensor:
    """``sum_i CE(softcap(head(hidden_i)), targets_i)`` in float32, ``step`` positions at a time.

    ``hidden`` (K, H), ``targets`` (K,) long. Differentiable in ``hidden`` and the layer's weight and
    bias; the backward holds one chunk's logits and one weight-sized gradient buffer."""
    return _LinearCrossEntropySum.apply(hidden, head.weight, head.bias, targets, step, cap)
