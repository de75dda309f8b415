"""Small random-init bases of several model families, built locally from a config (nothing downloaded).

Used by tests and by anyone checking that a federation runs on a family before pointing it at a real
model: ``make_random_base("gpt2", out_dir)`` writes a Hugging Face directory (single safetensors file)
with the built-in tiny model's tokenizer, its vocabulary size matched. ``chat_template=False`` strips
the template, like most base models ship.
"""

from __future__ import annotations

import pathlib

import torch

# hidden 64, 2 layers, 4 heads (2 key/value heads where the family has them), context 256
_SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=256)

FAMILIES = ("qwen3", "llama", "gpt2", "gemma", "phi3")


def small_config(family: str, *, vocab_size: int, eos_token_id: int, pad_token_id: int | None):
    """A transformers config of `family` with the _SMALL sizes."""
    from transformers import AutoConfig

    if family not in FAMILIES:
        raise ValueError(f"`family` must be one of {FAMILIES}, got {family!r}")
    ids = dict(vocab_size=vocab_size, eos_token_id=eos_token_id, pad_token_id=pad_token_id, bos_token_id=None)
    if family == "gpt2":
        return AutoConfig.for_model("gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=256, n_inner=128, **ids)
    extra = {"head_dim": 16} if family in ("qwen3", "gemma") else {}
    return AutoConfig.for_model(family, **_SMALL, **extra, tie_word_embeddings=True, **ids)


def make_random_base(family: str, out_dir: str | pathlib.Path, *, chat_template: bool = True, seed: int = 0,
                     pad_token: bool = True) -> pathlib.Path:
    """Write a random-init `family` base with the tiny model's tokenizer to `out_dir`; return it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from . import tiny_model_dir

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir()))
    if not chat_template:
        tok.chat_template = None
    if not pad_token:
        tok.pad_token = None
    cfg = small_config(family, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    model.save_pretrained(out, max_shard_size="1000GB")
    tok.save_pretrained(out)
    if not chat_template:
        (out / "chat_template.jinja").unlink(missing_ok=True)
    return out
