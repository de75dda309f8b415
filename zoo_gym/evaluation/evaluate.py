"""Held-out loss of a checkpoint, optionally with a weight delta added temporarily.

Used by the server (validation loss of a published checkpoint), by rewards scoring (base + one
contributor's delta) and by the client (loss before/after a round). The loss is the mean
next-token cross-entropy over completion tokens only (the answer and the end of its turn, split from the
prompt by the checkpoint's own chat template: ``chat.render_pair``), token-weighted over the whole
example set, so it does not depend on the batch size.
"""

from __future__ import annotations

import contextlib
import pathlib
from collections.abc import Mapping

import torch

from .chat import ensure_chat_template, render_pair


def load_model(model_dir: str | pathlib.Path, *, dtype: torch.dtype = torch.float32, attn_implementation=None):
    from transformers import AutoModelForCausalLM

    kw = {"dtype": dtype}
    if attn_implementation:
        kw["attn_implementation"] = attn_implementation
    return AutoModelForCausalLM.from_pretrained(str(model_dir), **kw)


def load_tokenizer(model_dir: str | pathlib.Path):
    """The checkpoint's tokenizer; one without a chat template gets chat.PLAIN_TEMPLATE, one without a
    pad token its eos token (chat.ensure_chat_template)."""
    from transformers import AutoTokenizer

    return ensure_chat_template(AutoTokenizer.from_pretrained(str(model_dir)))


def tokenize_examples(tokenizer, examples: list[dict]) -> list[tuple[list[int], list[int]]]:
    """Each example -> (prompt ids, completion ids) in the tokenizer's chat template (chat.render_pair);
    a plain `text` record (continued pretraining) is all completion: every token after the first is scored."""
    ensure_chat_template(tokenizer)
    out = []
    for ex in examples:
        if "text" in ex:
            ids = tokenizer(ex["text"], add_special_tokens=False)["input_ids"]
            out.append((ids[:1], ids[1:]))
            continue
        prompt, completion = render_pair(tokenizer, ex)
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        c = tokenizer(completion, add_special_tokens=False)["input_ids"]
        out.append((p, c))
    return out


def collate(pairs: list[tuple[list[int], list[int]]], *, pad_id: int) -> tuple[torch.Tensor, ...]:
    """Right-padded (B, T) input ids, attention mask, labels (-100 outside completions)."""
    T = max(len(p) + len(c) for p, c in pairs)
    ids = torch.full((len(pairs), T), pad_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(pairs), T), dtype=torch.long)  # (B, T)
    labels = torch.full((len(pairs), T), -100, dtype=torch.long)  # (B, T)
    for i, (p, c) in enumerate(pairs):
        n = len(p) + len(c)
        ids[i, :n] = torch.tensor(p + c)
        mask[i, :n] = 1
        labels[i, len(p):n] = torch.tensor(c)
    return ids, mask, labels


def dense_delta(value) -> torch.Tensor:
    """A delta value as a dense tensor: tensors pass through, LoRA factors are merged (B @ A)."""
    if isinstance(value, torch.Tensor):
        return value
    if hasattr(value, "merged"):
        return value.merged()
    raise TypeError(f"a delta value must be a Tensor or LoraFactors, got {type(value).__name__}")


# Rows of the output layer computed at once: (rows, vocab) float32 logits of about 64 MiB (110 rows
# at Qwen3's 151936 tokens), never a (positions, vocab) tensor for a whole batch.
HEAD_CHUNK_ELEMENTS = 1 << 24


def hidden_at(model, inputs: dict, at: torch.Tensor) -> torch.Tensor:
    """(K, H) hidden states entering the output layer at flat positions ``at`` (``b * T + t``): the decoder
    body runs on ``inputs`` and the output layer is called once on no position, so forward hooks on it run."""
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(model).__name__} has no output embeddings (lm_head): not a causal LM")
    grabbed: list[torch.Tensor] = []

    def grab(_module, args):
        grabbed.append(args[0])
        return (args[0][..., :0, :],) + tuple(args[1:])  # (B, 0, H): logits of no position

    handle = head.register_forward_pre_hook(grab)
    try:
        model(**inputs, use_cache=False)
    finally:
        handle.remove()
    if len(grabbed) != 1:
        raise ValueError(f"the output layer ran {len(grabbed)} times in one forward: expected once")
    h = grabbed.pop()                                                    # (B, T, H)
    return h.reshape(-1, h.shape[-1])[at]


def head_loss_sum(model, inputs: dict, *, at: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy of ``targets`` predicted at flat positions ``at``.

    ``model(**inputs)`` runs the decoder body; a pre-hook on the output layer
    (``get_output_embeddings()``, the lm_head) takes its input hidden states ``(B, T, H)`` and
    hands it an empty slice, so no logits are built over the whole batch. The lm_head is then
    applied only to the ``K`` hidden states at ``at`` (flat index ``b * T + t``), in chunks of
    about ``HEAD_CHUNK_ELEMENTS`` logits, each chunk's cross-entropy taken in float32 (Gemma-2
    style ``final_logit_softcapping`` applied as the model does). With gradients on, each chunk is
    recomputed in the backward (activation checkpointing), so only one chunk's logits live at a
    time. Equal to the full-logits loss up to float rounding (the matmul sees fewer rows).
    Differentiable when grad is enabled; ``at``, ``targets``: ``(K,)`` long on the model's device.
    """
    head = model.get_output_embeddings()
    hidden = hidden_at(model, inputs, at)                               # (K, H)
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)

    def chunk_loss(hc: torch.Tensor, tc: torch.Tensor) -> torch.Tensor:
        logits = head(hc).float()                                       # (k, V)
        if cap:
            logits = torch.tanh(logits / cap) * cap
        return torch.nn.functional.cross_entropy(logits, tc, reduction="sum")

    vocab = int(getattr(head, "out_features", None) or head.weight.shape[0])
    step = max(1, HEAD_CHUNK_ELEMENTS // max(vocab, 1))
    grad = torch.is_grad_enabled() and (hidden.requires_grad or head.weight.requires_grad)
    if grad and type(head) is torch.nn.Linear:  # one weight-gradient buffer for all chunks (head_loss.py)
        from zoo_gym.evaluation.head_loss import linear_cross_entropy_sum

        return linear_cross_entropy_sum(hidden, head, targets, step=step, cap=cap)
    total = hidden.new_zeros((), dtype=torch.float32)
    for i in range(0, hidden.shape[0], step):
        hc, tc = hidden[i:i + step], targets[i:i + step]
        if grad:
            from torch.utils.checkpoint import checkpoint

            total = total + checkpoint(chunk_loss, hc, tc, use_reentrant=False)
        else:
            total = total + chunk_loss(hc, tc)
    return total


def scored_positions(labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(at, targets)`` of right-padded labels ``(B, T)``: position ``t`` predicts label ``t + 1``
    wherever that label is not -100; ``at`` is the flat index ``b * T + t``."""
    B, T = labels.shape
    shift = labels[:, 1:]                                                # (B, T-1)
    b, t = torch.nonzero(shift != -100, as_tuple=True)                  # (K,), (K,)
    return b * T + t, shift[b, t]


def completion_loss_sum(model, batches, *, device=None) -> tuple[float, int]:
    """Sum of completion-token cross-entropies and their count over pre-collated batches
    (``head_loss_sum``: the output layer only where a completion token is predicted)."""
    total, count = 0.0, 0
    for ids, mask, labels in batches:
        if device is not None:
            ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
        at, targets = scored_positions(labels)
        if at.numel() == 0:
            continue
        total += float(head_loss_sum(model, {"input_ids": ids, "attention_mask": mask}, at=at, targets=targets))
        count += int(at.numel())
    return total, count


class Evaluator:
    """Mean completion-token loss of ``model_dir`` (plus an optional delta) on fixed examples.

    Tokenises once; :meth:`loss` adds ``scale * delta`` to the weights, evaluates under
    ``torch.inference_mode`` and restores the original weights bit for bit (from a saved copy).
    """

    def __init__(self, model_dir, examples: list[dict], *, batch_size: int = 64, model=None, tokenizer=None):
        if not examples:
            raise ValueError("`examples` must not be empty: there is nothing to evaluate the loss on")
        if batch_size < 1:
            raise ValueError(f"`batch_size` must be >= 1, got {batch_size}")
        self.model_dir = pathlib.Path(model_dir) if model_dir is not None else None
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
        self.model = model if model is not None else load_model(model_dir)
        self.model.eval()
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        pairs = tokenize_examples(self.tokenizer, examples)
        # sort by length so batches pad little; the token-weighted mean does not depend on order
        pairs.sort(key=lambda pc: len(pc[0]) + len(pc[1]))
        self._batches = [collate(pairs[i:i + batch_size], pad_id=pad) for i in range(0, len(pairs), batch_size)]

    @staticmethod
    @contextlib.contextmanager
    def applied(model, delta: Mapping[str, torch.Tensor] | None, *, scale: float = 1.0):
        """Within the block, ``model``'s weights are base + ``scale * delta``; restored bit for bit after.
        A model whose layers stream from disk (``zoo_gym.evaluation.streamed_model``) adds it as it loads them."""
        stream = getattr(model, "zoo_stream", None)
        if stream is not None:
            with stream.applied(delta, scale=scale):
                yield model
            return
        params = dict(model.named_parameters(remove_duplicate=True))
        saved: dict[str, torch.Tensor] = {}

        def target(name: str) -> torch.nn.Parameter:
            p = params.get(name)
            if p is None and name == "lm_head.weight":
                p = params.get("model.embed_tokens.weight")
            if p is None:
                raise KeyError(f"delta names {name!r}, which is not a parameter of the model")
            return p

        try:
            with torch.inference_mode():
                for name, value in (delta or {}).items():
                    p = target(name)
                    d = dense_delta(value)
                    if tuple(d.shape) != tuple(p.shape):
                        raise ValueError(f"delta {name!r} has shape {tuple(d.shape)}, the model's is {tuple(p.shape)}")
                    if name not in saved:
                        saved[name] = p.detach().clone()
                    p.add_(d.to(device=p.device, dtype=p.dtype), alpha=scale)
            yield model
        finally:
            with torch.inference_mode():
                for name, orig in saved.items():
                    target(name).copy_(orig)

    def loss(self, delta: Mapping[str, torch.Tensor] | None = None, *, scale: float = 1.0) -> float:
        """Mean completion-token loss of base + ``scale * delta`` (the weights are restored after)."""
        device = next(self.model.parameters()).device
        with self.applied(self.model, delta, scale=scale), torch.inference_mode():
            total, count = completion_loss_sum(self.model, self._batches, device=device)
        return total / max(count, 1)


def heldout_loss(model_dir, examples: list[dict], *, batch_size: int = 64) -> float:
    """Mean completion-token loss of the checkpoint in ``model_dir`` on ``examples``."""
    return Evaluator(model_dir, examples, batch_size=batch_size).loss()
