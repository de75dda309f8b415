"""Exact match of greedy answers, and perplexity on a shipped real-text retention set.

Exact match measures what training taught only if the model answers the very prompt it was trained
on: TRL's SFT and GRPO trainers tokenize ``chat.prompt_messages(ex)`` with the checkpoint's chat
template and the generation prompt (``apply_chat_template(..., tokenize=True, add_generation_prompt=True)``),
so ``generation_prompt_ids`` does exactly that, and nothing else (no extra BOS, no system prompt of
our own). Perplexity on ``retention_texts`` (the Apache-2.0 license and our own docs, shipped in
``retention/``) shows what fine-tuning cost the base's language modelling.
"""

from __future__ import annotations

import math
import pathlib
from dataclasses import dataclass
from importlib import resources

import torch

from zoo_gym.evaluation.chat import ensure_chat_template, prompt_messages

RETENTION_FILES = ("apache-2.0.txt", "training.md", "architecture.md")
# Paragraph-aligned chunks of about 1 KB: 58-371 tokens (median 198) for SmolLM2's tokenizer, a text-only
# split so the set is the same whatever the tokenizer; perplexity() cuts each at max_length tokens.
RETENTION_CHUNK_CHARS = 1024


@dataclass
class ExactMatch:
    """Share of exact answers over ``n`` examples, with the answers themselves (to see how they fail)."""

    accuracy: float
    n: int
    answers: list[str]


def load_for_eval(model_dir: str | pathlib.Path):
    """(model, tokenizer) of a checkpoint in float32, eval mode, on the CPU: measurements comparable anywhere."""
    from zoo_gym.evaluation.evaluate import load_model, load_tokenizer

    model = load_model(model_dir, dtype=torch.float32)
    model.to("cpu").eval()
    return model, load_tokenizer(model_dir)


def generation_prompt_ids(tokenizer, ex: dict) -> list[int]:
    """The token ids the trainers put before the answer of ``ex`` (TRL's tokenization of the prompt)."""
    enc = tokenizer.apply_chat_template(prompt_messages(ex), tokenize=True, add_generation_prompt=True,
                                        return_dict=True)
    return list(enc["input_ids"])


def _left_padded(rows: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(B, T) ids and attention mask, padded on the left so every row's next token is at position T."""
    T = max(len(r) for r in rows)
    ids = torch.full((len(rows), T), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), T), dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, T - len(r):] = torch.tensor(r, dtype=torch.long)
        mask[i, T - len(r):] = 1
    return ids, mask


def greedy_answers(model, tokenizer, examples: list[dict], *, max_new_tokens: int = 8,
                   batch_size: int = 32) -> list[str]:
    """The model's greedy completion of each example's prompt, decoded without special tokens."""
    ensure_chat_template(tokenizer)
    device = next(model.parameters()).device
    rows = [generation_prompt_ids(tokenizer, ex) for ex in examples]
    answers: list[str] = []
    for i in range(0, len(rows), batch_size):
        ids, mask = _left_padded(rows[i:i + batch_size], tokenizer.pad_token_id)
        with torch.inference_mode():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                 eos_token_id=tokenizer.eos_token_id)
        answers += tokenizer.batch_decode(out[:, ids.shape[1]:], skip_special_tokens=True)
    return answers


def exact_match(model, tokenizer, examples: list[dict], *, max_new_tokens: int = 8,
                batch_size: int = 32) -> ExactMatch:
    """Share of examples whose stripped greedy completion is exactly their stripped ``output``
    (the same test as ``grpo.exact_answer_reward``)."""
    if not examples:
        raise ValueError("`examples` must not be empty: there is nothing to match")
    answers = greedy_answers(model, tokenizer, examples, max_new_tokens=max_new_tokens, batch_size=batch_size)
    hits = sum(a.strip() == str(ex["output"]).strip() for a, ex in zip(answers, examples))
    return ExactMatch(accuracy=hits / len(examples), n=len(examples), answers=answers)


def _chunks(text: str, size: int) -> list[str]:
    """Paragraph-aligned pieces of about ``size`` characters (a paragraph longer than ``size`` stays whole)."""
    out, cur = [], ""
    for para in (p.strip() for p in text.split("\n\n")):
        if not para:
            continue
        if cur and len(cur) + len(para) > size:
            out.append(cur)
            cur = ""
        cur = f"{cur}\n\n{para}" if cur else para
    return out + ([cur] if cur else [])


def retention_texts() -> list[str]:
    """The shipped retention set (about 26 KB) as paragraph-aligned chunks of about 1 KB, in a fixed order."""
    root = resources.files(__package__) / "retention"
    return [c for name in RETENTION_FILES for c in _chunks((root / name).read_text(encoding="utf-8"),
                                                           RETENTION_CHUNK_CHARS)]


def perplexity(model, tokenizer, texts: list[str], *, max_length: int = 256, batch_size: int = 8) -> float:
    """exp of the token-weighted mean next-token loss over ``texts``, each cut to ``max_length`` tokens
    (every token after the first is scored: ``evaluate``'s loss of a plain ``text`` record)."""
    from zoo_gym.evaluation.evaluate import collate, completion_loss_sum

    if not texts:
        raise ValueError("`texts` must not be empty: there is nothing to score")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rows = [tokenizer(t, add_special_tokens=False)["input_ids"][:max_length] for t in texts]
    pairs = [(r[:1], r[1:]) for r in rows]
    batches = [collate(pairs[i:i + batch_size], pad_id=pad) for i in range(0, len(pairs), batch_size)]
    with torch.inference_mode():
        total, count = completion_loss_sum(model, batches, device=next(model.parameters()).device)
    return math.exp(total / max(count, 1))


def answer_loss(model, tokenizer, examples: list[dict], *, batch_size: int = 16) -> float:
    """Mean next-token loss (nats a token) of the gold answers given their prompts, as the trainer tokenizes
    them (``evaluate.tokenize_examples``): a continuous companion to exact match, far less noisy on a few hundred
    items, for comparisons such as leave-one-out gains."""
    from zoo_gym.evaluation.evaluate import collate, completion_loss_sum, tokenize_examples

    if not examples:
        raise ValueError("`examples` must not be empty: there is nothing to score")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    pairs = tokenize_examples(tokenizer, examples)
    batches = [collate(pairs[i:i + batch_size], pad_id=pad) for i in range(0, len(pairs), batch_size)]
    with torch.inference_mode():
        total, count = completion_loss_sum(model, batches, device=next(model.parameters()).device)
    return total / max(count, 1)
