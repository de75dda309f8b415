"""How well a model prefers the chosen answer of a pair: preference accuracy and mean margin.

A pair is an instruction record (``instruction``/``input`` or messages, as ``chat.prompt_messages``
reads them) with ``chosen`` and ``rejected`` answer strings. Its margin is the summed completion
log-likelihood of the chosen answer minus that of the rejected one, each rendered as the assistant
turn by the checkpoint's chat template (``chat.render_pair``). Accuracy is the share of pairs whose
margin is > 0; ``PreferenceEvaluator.report`` evaluates base + an optional delta and restores the weights.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .evaluate import collate, load_model, load_tokenizer, scored_positions, tokenize_examples


def is_pair(ex: dict) -> bool:
    return "chosen" in ex and "rejected" in ex


def _as_answers(pairs: list[dict]) -> list[dict]:
    """Each pair as two SFT records (chosen first, then rejected), in the same order."""
    out = []
    for ex in pairs:
        rest = {k: v for k, v in ex.items() if k not in ("chosen", "rejected", "output")}
        out += [{**rest, "output": ex["chosen"]}, {**rest, "output": ex["rejected"]}]
    return out


def completion_logprobs(model, batches, *, device) -> torch.Tensor:
    """Summed completion-token log-likelihood of every row of pre-collated ``batches``, in order."""
    out = []
    for ids, mask, labels in batches:
        ids, mask, labels = ids.to(device), mask.to(device), labels.to(device)
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()  # (B, T, V)
        at, targets = scored_positions(labels)                                # (K,), (K,)
        flat = logits.reshape(-1, logits.shape[-1])[at]                        # (K, V)
        lp = torch.log_softmax(flat, dim=-1).gather(1, targets[:, None])[:, 0]  # (K,)
        rows = torch.zeros(ids.shape[0], device=device).index_add_(0, at // ids.shape[1], lp)
        out.append(rows.cpu())
    return torch.cat(out) if out else torch.zeros(0)


class PreferenceEvaluator:
    """Preference accuracy and mean margin of a model (plus an optional delta) on fixed pairs."""

    def __init__(self, model_dir, pairs: list[dict], *, batch_size: int = 32, model=None, tokenizer=None):
        pairs = [p for p in pairs if is_pair(p)]
        if not pairs:
            raise ValueError("no preference pairs (records with `chosen` and `rejected`) to evaluate")
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(model_dir)
        self.model = model if model is not None else load_model(model_dir)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        rows = tokenize_examples(self.tokenizer, _as_answers(pairs))  # chosen, rejected, chosen, ...
        self.n = len(pairs)
        self._batches = [collate(rows[i:i + batch_size], pad_id=pad) for i in range(0, len(rows), batch_size)]

    def margins(self, delta: Mapping[str, torch.Tensor] | None = None, *, scale: float = 1.0) -> torch.Tensor:
        """(n,) log p(chosen) - log p(rejected) of base + ``scale * delta`` (weights restored after)."""
        from .evaluate import Evaluator

        was_training = self.model.training
        self.model.eval()
        device = next(self.model.parameters()).device
        try:
            with torch.inference_mode(), Evaluator.applied(self.model, delta, scale=scale):
                lp = completion_logprobs(self.model, self._batches, device=device)
        finally:
            self.model.train(was_training)
        return lp[0::2] - lp[1::2]

    def report(self, delta: Mapping[str, torch.Tensor] | None = None, *, scale: float = 1.0) -> dict:
        m = self.margins(delta, scale=scale)
        return {"preference_accuracy": float((m > 0).float().mean()), "preference_margin": float(m.mean()),
                "preference_pairs": self.n}


def preference_report(model, tokenizer, pairs: list[dict]) -> dict | None:
    """``PreferenceEvaluator(...).report()`` of an in-memory model, or None when ``pairs`` holds none."""
    if not any(is_pair(p) for p in pairs or []):
        return None
    return PreferenceEvaluator(None, pairs, model=model, tokenizer=tokenizer).report()
