"""Exact completion losses on a fixed example set, packed densely with its shared prefix computed once.

``pack_shared_prefix`` lays the examples out as a few dense rows ``[prefix, suffix_a, suffix_b, ...]``:
every suffix token attends to the prefix and causally to its own suffix, never to another example, with
position ids of its own example, so the logits at scored positions are the padded batch's (up to float
rounding). The prefix stops before the first position that predicts a completion token; pad positions
attend only to themselves; an example's last token is left out. Needs an attention implementation that
takes a 4D mask (``sdpa``, ``eager``); ``supports_packing`` says whether a model has one.
Why and references: docs/design/rewards-scoring.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from zoo_gym.evaluation.evaluate import HEAD_CHUNK_ELEMENTS, head_loss_sum, hidden_at

from .errors import EvaluationInputError
from .vocab_blocks import head_loss_sum as blocked_head_loss_sum
from .vocab_blocks import vocab_of

_PACKABLE_ATTENTION = ("sdpa", "eager")


@dataclass(frozen=True)
class PackedBatch:
    """Examples packed into dense rows (``pack_shared_prefix``); tensors on the CPU."""

    input_ids: Tensor      # (R, T) long
    position_ids: Tensor   # (R, T) long, each token's position in its own example
    allowed: Tensor        # (R, 1, T, T) bool, True where query t may attend to key s
    predict_at: Tensor     # (K,) long, flat index r * T + t of each position that predicts a target
    targets: Tensor        # (K,) long, the completion token predicted there
    examples: int          # examples packed
    target_example: Tensor  # (K,) long, the index (in the packed pairs' order) of the example each target is of
    prefix: int            # shared prefix length P, stored once per row

    @property
    def tokens(self) -> int:
        """Completion tokens the loss runs over (K)."""
        return int(self.targets.numel())

    def rows(self, start: int, stop: int) -> "PackedBatch":
        """Rows ``start:stop`` as a batch of their own (rows never attend to each other, so the
        loss sums of the parts add up to the whole's). ``examples`` is 0: the whole batch counts
        its examples, a part does not know which of them it holds."""
        R, T = self.input_ids.shape
        start, stop = max(0, start), min(R, stop)
        keep = (self.predict_at >= start * T) & (self.predict_at < stop * T)      # (K,) bool
        return PackedBatch(input_ids=self.input_ids[start:stop], position_ids=self.position_ids[start:stop],
                           allowed=self.allowed[start:stop], predict_at=self.predict_at[keep] - start * T,
                           targets=self.targets[keep], examples=0, target_example=self.target_example[keep],
                           prefix=self.prefix)


def _shared_prefix(seqs: Sequence[list[int]], first_scored: Sequence[int]) -> int:
    limit = min(min(first_scored), min(len(s) for s in seqs))
    p = 0
    while p < limit and all(s[p] == seqs[0][p] for s in seqs):
        p += 1
    return p


def pack_shared_prefix(pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *, pad_id: int,
                       row_tokens: int = 128) -> PackedBatch:
    """Pack ``(prompt ids, completion ids)`` pairs into rows of about ``row_tokens`` positions.

    The loss runs over the completion tokens exactly as ``evaluation.evaluate.collate`` labels
    them: token ``j`` of ``prompt + completion`` is predicted at position ``j - 1`` for every
    ``j >= max(len(prompt), 1)``. Each example's last token is left out of the input (it is only
    a target, nothing scored depends on it). The longest prefix that all examples share (and that ends
    before the first scored position of every example) is stored once per row. Suffixes go to
    ``ceil(total suffix tokens / (row_tokens - P))`` rows, longest first into the emptiest row
    (LPT), so the rows come out nearly equal; a suffix longer than a row gets a row of its own
    length. Deterministic: ties go to the lower row, examples keep their given order among equals.
    """
    if not pairs:
        raise EvaluationInputError("`pairs` is empty: there is nothing to compute a loss on")
    if row_tokens < 2:
        raise EvaluationInputError(f"`row_tokens` must be >= 2, got {row_tokens}")
    full = [list(p) + list(c) for p, c in pairs]
    first_scored = [max(len(p), 1) - 1 for p, _ in pairs]  # first position that predicts a target
    if sum(max(len(s) - 1 - f, 0) for s, f in zip(full, first_scored)) == 0:
        raise EvaluationInputError("no example has a completion token: nothing to compute a loss on")
    # An example's last token is only ever a target: no position of its own example comes after
    # it, so it is never an input anything scored depends on. Dropped (exact; 1 position each).
    seqs = [s[:-1] for s in full]
    P = _shared_prefix(seqs, first_scored)
    suffix = [len(s) - P for s in seqs]
    room = max(row_tokens - P, 1)
    rows = max(1, min(len(seqs), math.ceil(sum(suffix) / room)))
    order = sorted(range(len(seqs)), key=lambda i: (-suffix[i], i))
    bins: list[list[int]] = [[] for _ in range(rows)]
    fill = [0] * rows
    for i in order:
        r = min(range(rows), key=lambda k: (fill[k], k))
        bins[r].append(i)
        fill[r] += suffix[i]
    T = P + max(fill)
    ids = torch.full((rows, T), pad_id, dtype=torch.long)                 # (R, T)
    pos = torch.zeros((rows, T), dtype=torch.long)                        # (R, T)
    allowed = torch.zeros((rows, 1, T, T), dtype=torch.bool)              # (R, 1, T, T)
    causal = torch.ones((T, T), dtype=torch.bool).tril()                  # (T, T)
    prefix = torch.tensor(seqs[0][:P], dtype=torch.long)                  # (P,)
    predict_at: list[int] = []
    targets: list[int] = []
    target_example: list[int] = []
    for r, members in enumerate(bins):
        ids[r, :P] = prefix
        pos[r, :P] = torch.arange(P)
        allowed[r, 0, :P, :P] = causal[:P, :P]
        o = P
        for i in sorted(members):
            s, n = seqs[i], suffix[i]
            ids[r, o:o + n] = torch.tensor(s[P:], dtype=torch.long)
            pos[r, o:o + n] = torch.arange(P, len(s))
            allowed[r, 0, o:o + n, :P] = True
            allowed[r, 0, o:o + n, o:o + n] = causal[:n, :n]
            for j in range(first_scored[i] + 1, len(full[i])):  # token j: predicted at j - 1 >= P
                predict_at.append(r * T + o + (j - 1 - P))
                targets.append(full[i][j])
                target_example.append(i)
            o += n
        for t in range(o, T):  # pads see only themselves: finite, and invisible to the rest
            allowed[r, 0, t, t] = True
    return PackedBatch(input_ids=ids, position_ids=pos, allowed=allowed,
                       predict_at=torch.tensor(predict_at, dtype=torch.long),
                       targets=torch.tensor(targets, dtype=torch.long), examples=len(seqs),
                       target_example=torch.tensor(target_example, dtype=torch.long), prefix=P)


def supports_packing(model: torch.nn.Module) -> bool:
    """Whether the model's attention takes the 4D mask packing needs (sdpa or eager)."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    return impl in _PACKABLE_ATTENTION


def _packed_inputs(model: torch.nn.Module, batch: PackedBatch) -> dict:
    """The decoder's inputs for the packed rows: ids, own positions and the 4D mask (additive for eager)."""
    impl = getattr(model.config, "_attn_implementation", None)
    if impl not in _PACKABLE_ATTENTION:
        raise EvaluationInputError(f"packed scoring needs attention 'sdpa' or 'eager' (a 4D mask); "
                                f"the model uses {impl!r}: load it with attn_implementation='sdpa'")
    device = next(model.parameters()).device
    dtype = torch.float32 if vocab_of(model) is not None else next(model.parameters()).dtype  # bf16 embedding
    mask = batch.allowed.to(device)
    if impl == "eager":  # eager adds the mask to the scores
        mask = torch.zeros(mask.shape, dtype=dtype, device=device).masked_fill_(
            ~mask, torch.finfo(dtype).min)
    return {"input_ids": batch.input_ids.to(device), "position_ids": batch.position_ids.to(device),
            "attention_mask": mask}


def packed_loss_sum(model: torch.nn.Module, batch: PackedBatch) -> tuple[Tensor, int]:
    """``(sum of completion-token cross-entropies, their count)``; differentiable when grad is on.

    The decoder body runs on the packed rows; the output layer only at ``predict_at``, a chunk of
    positions at a time (``evaluation.evaluate.head_loss_sum``): no ``(R, T, vocab)`` logits."""
    inputs = _packed_inputs(model, batch)
    device = next(model.parameters()).device
    # the lm_head runs only at the K positions that predict a completion token, in chunks
    loss_sum = blocked_head_loss_sum if vocab_of(model) is not None else head_loss_sum  # vocab_blocks.py
    loss = loss_sum(model, inputs, at=batch.predict_at.to(device), targets=batch.targets.to(device))
    return loss, batch.tokens


def packed_misses(model: torch.nn.Module, batch: PackedBatch) -> Tensor:
    """(examples,) bool: True where some completion token is not the model's most likely next token given the
    example's tokens before it. An example with no miss is exactly what greedy decoding from its prompt
    writes (each greedy step sees the same prefix as teacher forcing does), so ``1 - misses.mean()`` is greedy
    exact match, from one forward pass instead of a generation loop. Ties in the argmax go to the lower id."""
    if batch.examples <= 0:
        raise EvaluationInputError("misses are counted on a whole packed batch (`rows()` parts know no examples)")
    inputs = _packed_inputs(model, batch)
    device = next(model.parameters()).device
    hidden = hidden_at(model, inputs, batch.predict_at.to(device))       # (K, H)
    head = model.get_output_embeddings()
    step = max(1, HEAD_CHUNK_ELEMENTS // max(int(head.weight.shape[0]), 1))
    with torch.no_grad():  # softcapping is monotone: the argmax of the raw logits is the model's
        best = torch.cat([head(hidden[i:i + step]).argmax(-1) for i in range(0, hidden.shape[0], step)])
    wrong = (best.cpu() != batch.targets)                                 # (K,)
    misses = torch.zeros(batch.examples, dtype=torch.bool)
    misses[batch.target_example[wrong]] = True
    return misses
