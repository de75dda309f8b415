"""Make the built-in tiny base model ``tiny`` deterministically: ``python -m zoo_gym.gym_train.make_tiny OUT``.

A Qwen3-architecture causal LM (Yang et al., "Qwen3 Technical Report", 2025) of ~0.9M fp32
parameters, with a byte-level BPE tokenizer trained here on the built-in corpus (digits split one per
token), ChatML template, briefly pretrained on the ``PRETRAIN_TASKS`` mixture only. The output is a
standard Hugging Face directory that ``AutoModelForCausalLM`` / ``AutoTokenizer.from_pretrained`` load.

Determinism: fixed seeds, one CPU thread, ``torch.use_deterministic_algorithms(True)``, a fixed number
of steps (not a time budget), so the same versions of torch/transformers/tokenizers give the same bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import random
import time
from dataclasses import dataclass

import torch

from zoo_gym.evaluation.chat import CHAT_TEMPLATE, IM_END, IM_START, PAD, render_completion, render_prompt

from .tasks import PRETRAIN_TASKS, TASKS, TINY_TASKS


@dataclass(frozen=True)
class TinySpec:
    vocab_size: int = 400  # BPE target; digits, bytes and the three specials are always in
    hidden_size: int = 128
    intermediate_size: int = 384
    num_hidden_layers: int = 4
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    max_position_embeddings: int = 256
    pretrain_steps: int = 700
    batch_size: int = 64
    learning_rate: float = 3e-3
    seed: int = 1234


def _corpus(seed: int, n: int = 3000) -> list[str]:
    """Text the tokenizer is trained on: every tiny family's prompts and answers (incl. the unseen ones)."""
    rng = random.Random(seed)
    out = []
    for name in sorted(TINY_TASKS):
        for _ in range(n // len(TINY_TASKS)):
            ex = TASKS[name](rng)
            out.append(render_prompt(ex) + render_completion(ex))
    return out


def build_tokenizer(spec: TinySpec = TinySpec()):
    """Byte-level BPE with digits one per token, wrapped as a transformers fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(spec.seed), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=IM_END, pad_token=PAD, bos_token=None, unk_token=None
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.padding_side = "right"
    return fast


def build_config(tokenizer, spec: TinySpec = TinySpec()):
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD),
        dtype="float32",
    )


def _batch(tokenizer, examples: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded (B, T) input ids, attention mask and labels (-100 outside the completion)."""
    rows, labs = [], []
    for ex in examples:
        p = tokenizer(render_prompt(ex), add_special_tokens=False)["input_ids"]
        c = tokenizer(render_completion(ex), add_special_tokens=False)["input_ids"]
        rows.append(p + c)
        labs.append([-100] * len(p) + c)
    T = max(len(r) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r + [pad] * (T - len(r)) for r in rows])  # (B, T)
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in rows])  # (B, T)
    labels = torch.tensor([lab + [-100] * (T - len(lab)) for lab in labs])  # (B, T)
    return ids, mask, labels


def pretrain(model, tokenizer, spec: TinySpec = TinySpec(), *, steps: int | None = None, log: bool = False):
    """Plain next-token pretraining on the PRETRAIN_TASKS mixture (completion tokens only)."""
    steps = spec.pretrain_steps if steps is None else steps
    rng = random.Random(spec.seed + 1)
    opt = torch.optim.AdamW(model.parameters(), lr=spec.learning_rate, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * max(0.05, 1.0 - s / max(steps, 1))
    )
    model.train()
    t0 = time.time()
    for step in range(steps):
        exs = [TASKS[PRETRAIN_TASKS[rng.randrange(len(PRETRAIN_TASKS))]](rng) for _ in range(spec.batch_size)]
        ids, mask, labels = _batch(tokenizer, exs)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if log and (step % 100 == 0 or step == steps - 1):
            print(f"step {step} loss {loss.item():.4f} ({time.time() - t0:.0f}s)", flush=True)
    model.eval()
    return model


def make_tiny(out_dir: str | pathlib.Path, spec: TinySpec = TinySpec(), *, steps: int | None = None,
              log: bool = False) -> pathlib.Path:
    """Write the tiny model directory; returns its path. Same versions -> same bytes."""
    from transformers import AutoModelForCausalLM

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    n_threads = torch.get_num_threads()
    det = torch.are_deterministic_algorithms_enabled()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    try:
        tokenizer = build_tokenizer(spec)
        config = build_config(tokenizer, spec)
        torch.manual_seed(spec.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        pretrain(model, tokenizer, spec, steps=steps, log=log)
        model.generation_config.do_sample = False
        model.generation_config.eos_token_id = config.eos_token_id
        model.generation_config.pad_token_id = config.pad_token_id
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)
    finally:
        torch.set_num_threads(n_threads)
        torch.use_deterministic_algorithms(det)
    return out


def dir_digest(path: str | pathlib.Path) -> dict[str, str]:
    """sha256 of every file of a model directory."""
    p = pathlib.Path(path)
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(p.iterdir()) if f.is_file()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out_dir")
    ap.add_argument("--steps", type=int, default=None, help="pretraining steps (default: the shipped recipe)")
    args = ap.parse_args(argv)
    t0 = time.time()
    out = make_tiny(args.out_dir, steps=args.steps, log=True)
    print(json.dumps({"dir": str(out), "seconds": round(time.time() - t0, 1), "sha256": dir_digest(out)}, indent=1))


if __name__ == "__main__":
    main()
