"""Continued pretraining on plain `text` records: the loss is on every token, and it goes down."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

from zoo_gym.gym_train import TrainConfig, load_examples, tiny_model_dir, train
from zoo_gym.evaluation.evaluate import load_tokenizer, tokenize_examples


def _corpus(n: int = 64) -> list[dict]:
    return [{"text": f"The number {i} is followed by {i + 1}, and then by {i + 2}."} for i in range(n)]


def test_text_records_load_only_where_allowed_and_score_every_token(tmp_path):
    path = tmp_path / "corpus.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _corpus(8)))
    with pytest.raises(ValueError, match="text"):
        load_examples(path)  # the server's validation set: instruction records only
    examples = load_examples(path, allow_text=True)
    assert examples[0] == {"text": "The number 0 is followed by 1, and then by 2."}
    tok = load_tokenizer(tiny_model_dir())
    prompt, completion = tokenize_examples(tok, examples[:1])[0]
    assert prompt + completion == tok(examples[0]["text"], add_special_tokens=False)["input_ids"]
    assert len(prompt) == 1  # every token after the first is scored


def test_lora_continued_pretraining_lowers_the_heldout_loss_on_text():
    config = TrainConfig(method="lora", max_steps=20, batch_size=8, warmup_steps=0, learning_rate=1e-2, seed=0)
    with contextlib.redirect_stdout(io.StringIO()):
        result = train(tiny_model_dir(), _corpus(), config, base_sha256="0" * 64)
    meta = result.metadata
    assert meta["loss_after"] < 0.9 * meta["loss_before"], meta
    assert result.delta  # a delta against the base, as for instruction data


def test_text_with_grpo_or_mixed_with_instructions_is_refused_before_training():
    with pytest.raises(ValueError, match="--stage sft without DP-SGD"):
        train(tiny_model_dir(), _corpus(8), TrainConfig(method="grpo", max_steps=2, warmup_steps=0),
              base_sha256="0" * 64)
    mixed = _corpus(8) + [{"instruction": "Add 1 and 2.", "input": "", "output": "3"}]
    with pytest.raises(ValueError, match="mix"):
        train(tiny_model_dir(), mixed, TrainConfig(max_steps=2, warmup_steps=0), base_sha256="0" * 64)


def test_epochs_become_steps_for_library_callers():
    # 64 examples, 6 held out (a tenth), 58 to train in batches of 8: 8 batches per epoch, 2 epochs = 16 steps
    config = TrainConfig(method="lora", num_train_epochs=2, batch_size=8, warmup_steps=0, seed=0)
    with contextlib.redirect_stdout(io.StringIO()):
        result = train(tiny_model_dir(), _corpus(64), config, base_sha256="0" * 64)
    assert result.metadata["steps"] == 16
