"""Activation checkpointing by a memory budget, for the base gradient's backward pass.

``checkpoint_beyond(model, budget)`` counts the bytes the autograd graph saves as the forward runs
(``torch.autograd.graph.saved_tensors_hooks``; the model's own weights are not counted), and every
decoder layer that starts after the count passed ``budget`` runs under ``torch.utils.checkpoint``
(non-reentrant). Layers that fit keep their activations. Decoder layers are the classes the model lists
in ``_no_split_modules``; a model without it runs unchanged. Why: docs/design/rewards-scoring.md.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils.checkpoint import checkpoint


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks (``_no_split_modules`` classes), in forward order."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    return [m for m in model.modules() if type(m).__name__ in names]


@contextmanager
def checkpoint_beyond(model: torch.nn.Module, budget_bytes: int | None) -> Iterator[dict]:
    """Within the block, decoder layers that start once saved activations exceed ``budget_bytes`` are
    checkpointed. Yields a dict whose ``"checkpointed"`` counts them and ``"saved_bytes"`` the bytes kept
    (read it after the forward). ``budget_bytes=None`` checkpoints nothing."""
    stats = {"checkpointed": 0, "saved_bytes": 0}
    layers = decoder_layers(model) if budget_bytes is not None else []
    if not layers:
        yield stats
        return
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in weights and ptr not in seen:  # each storage once: views share one
            seen.add(ptr)
            stats["saved_bytes"] += storage.nbytes()
        return t

    def budgeted(forward):
        def run(*args, **kwargs):
            if stats["saved_bytes"] > budget_bytes:
                stats["checkpointed"] += 1
                return checkpoint(forward, *args, use_reentrant=False, **kwargs)
            return forward(*args, **kwargs)
        return run

    patched = [(layer, layer.__dict__.get("forward")) for layer in layers]
    for layer in layers:
        layer.forward = budgeted(layer.forward)  # an instance attribute: nn.Module calls it first
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield stats
    finally:
        for layer, before in patched:
            if before is None:
                del layer.forward  # the class's forward again
            else:
                layer.forward = before
