"""GRPO with LoRA through TRL's ``GRPOTrainer`` and the built-in verifiable rewards.

GRPO: Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning", 2024 (group-relative
advantages, no value model). GSPO: Zheng et al., "Group Sequence Policy Optimization", 2025, which is
TRL's ``importance_sampling_level="sequence"``.

Rewards take TRL's calling convention ``(completions, **dataset_columns) -> list[float]``;
conversational completions arrive as lists of messages.
"""

from __future__ import annotations

import pathlib
import re
import tempfile
import time

import torch

from .chat import prompt_messages, render_prompt_with
from .common import (TrainResult, common_training_args, load_training_model, quiet_libraries, quiet_trainer,
                     split_heldout)
from .config import TrainConfig
from .delta import load_base_state
from .finetuning import delta_of, prepare
from .optimizers import trainer_optimizers
from .evaluate import Evaluator, load_tokenizer

_INT = re.compile(r"-?\d+")


def completion_text(completion) -> str:
    """The assistant text of one completion (a string, or TRL's list of chat messages)."""
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content", ""))
    return str(completion)


def exact_answer_reward(completions, answer, **_) -> list[float]:
    """1.0 when the completion, stripped, is exactly the expected answer, else 0.0."""
    return [1.0 if completion_text(c).strip() == str(a).strip() else 0.0 for c, a in zip(completions, answer)]


def format_reward(completions, **_) -> list[float]:
    """0.25 when the completion is a bare integer (the answer format), else 0.0."""
    return [0.25 if _INT.fullmatch(completion_text(c).strip()) else 0.0 for c in completions]


REWARD_FUNCS = (exact_answer_reward, format_reward)


def grpo_dataset(examples: list[dict]):
    from datasets import Dataset

    return Dataset.from_list([{"prompt": prompt_messages(ex), "answer": ex["output"]} for ex in examples])


def mean_reward(model, tokenizer, examples: list[dict], *, max_new_tokens: int, batch_size: int = 64) -> float:
    """Mean summed reward of greedy completions on ``examples`` (deterministic)."""
    total = 0.0
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    device = next(model.parameters()).device
    try:
        for i in range(0, len(examples), batch_size):
            chunk = examples[i:i + batch_size]
            enc = tokenizer([render_prompt_with(tokenizer, e) for e in chunk], return_tensors="pt", padding=True,
                            add_special_tokens=False).to(device)
            with torch.inference_mode():
                out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                     pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
            texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
            answers = [e["output"] for e in chunk]
            for f in REWARD_FUNCS:
                total += sum(f(texts, answer=answers))
    finally:
        tokenizer.padding_side = old_side
    return total / len(examples)


def train_grpo(base_dir, examples, config: TrainConfig, *, base_sha256: str, eval_examples=None,
               progress: bool = False):
    from transformers import set_seed
    from trl import GRPOConfig, GRPOTrainer

    quiet_libraries(progress)
    set_seed(config.seed)
    base_dir = pathlib.Path(base_dir)
    train_ex, held = split_heldout(examples, eval_examples)
    held = (held or [])[: config.grpo_eval_prompts]
    names, base_state = load_base_state(base_dir)
    tokenizer = load_tokenizer(base_dir)
    tokenizer.padding_side = "left"
    model = load_training_model(base_dir, config)
    gen_len = config.max_completion_length
    reward_before = mean_reward(model, tokenizer, held, max_new_tokens=gen_len) if held else None
    loss_before = Evaluator(None, held, model=model, tokenizer=tokenizer).loss() if held else None

    model, initial = prepare(model, config)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="zoo_gym_grpo_") as tmp:
        args = GRPOConfig(
            **common_training_args(config, tmp, progress=progress),
            num_generations=config.num_generations,
            max_completion_length=gen_len,
            temperature=config.temperature,
            beta=0.0 if config.beta is None else config.beta,
            importance_sampling_level=config.importance_sampling_level,
            **({"loss_type": config.loss_type} if config.loss_type else {}),
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=list(REWARD_FUNCS),
            args=args,
            train_dataset=grpo_dataset(train_ex),
            processing_class=tokenizer,
            optimizers=trainer_optimizers(model, config),
        )
        quiet_trainer(trainer, progress)
        trainer.train()
    seconds = time.perf_counter() - t0
    model = trainer.model
    model.eval()
    reward_after = mean_reward(model, tokenizer, held, max_new_tokens=gen_len) if held else None
    tokenizer.padding_side = "right"
    loss_after = Evaluator(None, held, model=model, tokenizer=tokenizer).loss() if held else None
    train_rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]

    delta = delta_of(model, config, base_state, names, initial=initial)
    steps = int(trainer.state.global_step)
    meta = {
        **config.identity(),
        "steps": steps,
        "examples_seen": steps * config.batch_size,  # completions scored
        "prompts_seen": steps * config.batch_size // config.num_generations,
        "tokens_seen": int(trainer.state.num_input_tokens_seen),
        "train_seconds": round(seconds, 3),
        "loss_before": loss_before,
        "loss_after": loss_after,
        "reward_before": reward_before,  # greedy, held-out prompts, exact (1) + format (0.25)
        "reward_after": reward_after,
        "train_reward_first": train_rewards[0] if train_rewards else None,  # sampled, as logged by TRL
        "train_reward_last": train_rewards[-1] if train_rewards else None,
        "heldout_examples": len(held),
        "importance_sampling_level": config.importance_sampling_level,
        "epsilon": None,
        "dp_delta": None,
        "base_sha256": base_sha256,
        "seed": config.seed,
        "delta_format": "dense" if isinstance(next(iter(delta.values())), torch.Tensor) else "lora_factors",
    }
    return TrainResult(delta=delta, base_sha256=base_sha256, metadata=meta)
