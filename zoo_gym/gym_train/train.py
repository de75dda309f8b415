"""One contributor's local training round, returning a delta against the base.

``train`` checks its inputs and hands the round to its stage: SFT here (TRL's ``SFTTrainer``), the
preference stages in ``preference.py``, the RL stages in ``grpo.py``, DP-SGD in ``dp.py``. Which
weights train, and the delta they send, is ``finetuning.py``'s.
"""

from __future__ import annotations

import dataclasses
import pathlib
import tempfile
import time

from zoo_gym.evaluation.chat import prompt_messages
from zoo_gym.evaluation.evaluate import Evaluator, load_tokenizer

from .common import (TrainResult, common_training_args, load_training_model, quiet_libraries, quiet_trainer,
                     round_metadata, split_heldout)
from .config import PREFERENCE_STAGES, RL_STAGES, TrainConfig
from .delta import load_base_state
from .finetuning import delta_of, prepare
from .formats import check_stage_data
from .hardware import check_hardware
from .optimizers import trainer_optimizers


def is_plain_text(examples: list[dict]) -> bool:
    """True for continued-pretraining data ({"text": ...} records); refuses a mix with instruction records."""
    kinds = {"text" in ex for ex in examples}
    if len(kinds) > 1:
        raise ValueError("the examples mix plain `text` records with instruction records; use one kind per "
                         "data file (text for continued pretraining, or instructions for fine-tuning)")
    return kinds == {True}


def sft_dataset(examples: list[dict]):
    """Rows for TRL: conversational prompt/completion (the loss is on the completion only), or plain
    `text` rows for continued pretraining (the loss is on every token)."""
    from datasets import Dataset

    if is_plain_text(examples):
        return Dataset.from_list([{"text": ex["text"]} for ex in examples])
    rows = [
        {"prompt": prompt_messages(ex), "completion": [{"role": "assistant", "content": ex["output"]}]}
        for ex in examples
    ]
    return Dataset.from_list(rows)


def _run_sft(model, tokenizer, train_ex, cfg: TrainConfig, tmp: str, progress: bool):
    from trl import SFTConfig, SFTTrainer

    text = is_plain_text(train_ex)
    args = SFTConfig(
        **common_training_args(cfg, tmp, progress=progress),
        completion_only_loss=not text and cfg.assistant_only_loss,  # assistant_only_loss: the answer's tokens
        dataset_text_field="text",
        max_length=cfg.max_length,
        packing=cfg.packing,
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=sft_dataset(train_ex), processing_class=tokenizer,
                         optimizers=trainer_optimizers(model, cfg))
    quiet_trainer(trainer, progress)
    trainer.train()
    return trainer


def train(
    base_dir,
    examples: list[dict],
    config: TrainConfig,
    *,
    base_sha256: str,
    eval_examples: list[dict] | None = None,
    progress: bool = False,
) -> TrainResult:
    """Fine-tune ``base_dir`` on ``examples`` with ``config``; return the delta against that base.

    ``eval_examples`` are the local held-out set for loss before/after (default: the last tenth of
    ``examples``, at most 64, held out from training when there are at least 10).
    """
    if not isinstance(config, TrainConfig):
        raise TypeError(f"`config` must be a TrainConfig, got {type(config).__name__}")
    if not examples:
        raise ValueError("`examples` is empty: give at least one training example")
    if not isinstance(base_sha256, str) or not base_sha256:
        raise ValueError("`base_sha256` must name the base checkpoint the delta is relative to")
    check_stage_data(config.stage, examples)
    base_dir = pathlib.Path(base_dir)
    check_hardware(config, base_dir)
    if config.num_train_epochs is not None:  # epochs -> the step count every training path understands
        n_train = len(split_heldout(examples, eval_examples)[0])
        config = dataclasses.replace(config, max_steps=config.steps_for(n_train), num_train_epochs=None)
    config = dataclasses.replace(config, warmup_steps=config.warmup_for(config.max_steps))  # DP-SGD reads steps
    if config.use_liger_kernel:  # Liger patches transformers for the whole process: undone when training ends
        from .process_patches import restored_modeling_module

        with restored_modeling_module(base_dir):
            return _dispatch(base_dir, examples, config, base_sha256=base_sha256, eval_examples=eval_examples,
                             progress=progress)
    return _dispatch(base_dir, examples, config, base_sha256=base_sha256, eval_examples=eval_examples,
                     progress=progress)


def _dispatch(base_dir: pathlib.Path, examples: list[dict], config: TrainConfig, *, base_sha256: str,
              eval_examples: list[dict] | None, progress: bool) -> TrainResult:
    if config.stage != "sft" or config.dp_enabled:
        if is_plain_text(examples):
            raise ValueError("plain `text` records train only with --stage sft without DP-SGD: preference and RL "
                             "stages need prompts with answers, and DP-SGD here trains on instruction records")
        run = _stage_runner(config)
        return run(base_dir, examples, config, base_sha256=base_sha256, eval_examples=eval_examples,
                   progress=progress)
    return _train_sft(base_dir, examples, config, base_sha256=base_sha256, eval_examples=eval_examples,
                      progress=progress)


def _stage_runner(config: TrainConfig):
    """The function that trains ``config``'s stage (each loads only its own libraries)."""
    if config.dp_enabled:
        from .dp import train_dp

        return train_dp
    if config.stage in RL_STAGES:
        from .grpo import train_grpo

        return train_grpo
    if config.stage in PREFERENCE_STAGES:
        from .preference import train_preference

        return train_preference
    raise ValueError(f"stage {config.stage!r} has no trainer")


def _train_sft(base_dir, examples, config: TrainConfig, *, base_sha256: str, eval_examples, progress: bool):

    from transformers import set_seed

    quiet_libraries(progress)
    set_seed(config.seed)
    train_ex, held = split_heldout(examples, eval_examples)
    names, base_state = load_base_state(base_dir)
    tokenizer = load_tokenizer(base_dir)
    tokenizer.padding_side = "right"
    model = load_training_model(base_dir, config)
    loss_before = Evaluator(None, held, model=model, tokenizer=tokenizer).loss() if held else None

    model, initial = prepare(model, config)

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zoo_gym_train_") as tmp:
        trainer = _run_sft(model, tokenizer, train_ex, config, tmp, progress)
    seconds = time.perf_counter() - t0
    model = trainer.model
    model.eval()
    loss_after = Evaluator(None, held, model=model, tokenizer=tokenizer).loss() if held else None

    delta = delta_of(model, config, base_state, names, initial=initial)

    steps = int(trainer.state.global_step)
    meta = round_metadata(config, delta, base_sha256=base_sha256, **{
        "steps": steps,
        "examples_seen": steps * config.batch_size * config.gradient_accumulation_steps,
        "tokens_seen": int(trainer.state.num_input_tokens_seen),
        "train_seconds": round(seconds, 3),
        "loss_before": loss_before,
        "loss_after": loss_after,
        "heldout_examples": len(held) if held else 0,
    })
    return TrainResult(delta=delta, base_sha256=base_sha256, metadata=meta)
