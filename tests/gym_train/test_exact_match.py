"""exact_match.py on the tiny model: greedy exact match over the very prompt training sees, the shipped
retention set and its perplexity."""

from __future__ import annotations

import math
import random
import tomllib
from pathlib import Path

import pytest
import torch

from zoo_gym.gym_train import tiny_model_dir
from zoo_gym.evaluation.chat import render_completion, render_prompt, render_prompt_with
from zoo_gym.gym_train.exact_match import (RETENTION_FILES, exact_match, generation_prompt_ids, load_for_eval,
                                           perplexity, retention_texts)
from zoo_gym.gym_train.tasks import builtin_examples
from zoo_gym.gym_train.train import sft_dataset

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny():
    return load_for_eval(tiny_model_dir())


def _examples():
    # digit copying: a pretraining family of the tiny base, so some answers are right and some wrong
    return builtin_examples("copy", n=12, seed=5) + builtin_examples("default", n=12, seed=5)


def test_load_for_eval_is_float32_eval_mode_on_cpu(tiny):
    model, _ = tiny
    p = next(model.parameters())
    assert p.dtype == torch.float32 and p.device.type == "cpu" and not model.training


def test_exact_match_is_a_share_with_one_answer_per_example(tiny):
    model, tok = tiny
    res = exact_match(model, tok, _examples(), max_new_tokens=10, batch_size=5)
    assert 0.0 <= res.accuracy <= 1.0 and res.n == 24 and len(res.answers) == 24
    assert res.answers[0].strip() == _examples()[0]["output"]  # the tiny base copies digits
    with pytest.raises(ValueError, match="must not be empty"):
        exact_match(model, tok, [])


def test_the_generation_prompt_is_the_prompt_training_tokenizes(tiny):
    """The ids generation starts from are the prefix TRL's SFT tokenization gives the same example (its
    conversational prompt/completion row through the chat template), and the text evaluation renders."""
    _, tok = tiny
    for ex in _examples():
        row = sft_dataset([ex])[0]
        full = tok.apply_chat_template(row["prompt"] + row["completion"], tokenize=True, return_dict=True)["input_ids"]
        prompt = generation_prompt_ids(tok, ex)
        assert list(full[:len(prompt)]) == prompt and len(full) > len(prompt)
        assert prompt == tok(render_prompt_with(tok, ex), add_special_tokens=False)["input_ids"]
        assert render_prompt_with(tok, ex) == render_prompt(ex)  # the tiny model's pretraining format


def test_batched_left_padded_answers_are_the_one_by_one_answers(tiny):
    """Exact match scores the model's own greedy answer to the training prompt: setting each example's output
    to the answer generated alone from the training prompt's ids scores 1.0 in batches of mixed lengths."""
    model, tok = tiny
    examples = _examples()[::2]
    alone = []
    for ex in examples:
        ids = torch.tensor([generation_prompt_ids(tok, ex)])
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=10,
                             pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
        alone.append(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip())
    relabelled = [{**ex, "output": a} for ex, a in zip(examples, alone)]
    res = exact_match(model, tok, relabelled, max_new_tokens=10, batch_size=7)
    assert res.accuracy == 1.0, list(zip(res.answers, alone))


def test_retention_texts_are_deterministic_chunks_of_the_shipped_files():
    texts = retention_texts()
    assert texts == retention_texts() and len(texts) >= 15
    assert all(100 < len(t) < 3000 for t in texts)
    assert "Apache License" in texts[0] and sum(map(len, texts)) > 20_000


def test_the_retention_files_are_package_data():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert "retention/*" in data["zoo_gym.gym_train"]
    assert all((ROOT / "zoo_gym/gym_train/retention" / name).is_file() for name in RETENTION_FILES)


def test_perplexity_is_lower_on_text_the_model_was_pretrained_on(tiny):
    model, tok = tiny
    seen = [render_prompt(ex) + render_completion(ex) for ex in builtin_examples("copy", n=8, seed=1)]
    rng = random.Random(0)
    noise = [tok.decode([rng.randrange(3, len(tok)) for _ in range(40)]) for _ in range(8)]
    p_seen, p_noise = perplexity(model, tok, seen, batch_size=3), perplexity(model, tok, noise, batch_size=3)
    assert math.isfinite(p_seen) and math.isfinite(p_noise) and 1.0 < p_seen < p_noise / 4, (p_seen, p_noise)
    assert perplexity(model, tok, seen, batch_size=8) == pytest.approx(p_seen, rel=1e-5)
