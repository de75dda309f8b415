"""The RL stages through TRL: rloo (``RLOOTrainer``), grpo and gspo (``GRPOTrainer``), on reward functions.

GRPO: Shao et al., "DeepSeekMath: Pushing the Limits of Mathematical Reasoning", 2024 (group-relative
advantages, no value model). GSPO: Zheng et al., "Group Sequence Policy Optimization", 2025, which is
TRL's ``importance_sampling_level="sequence"``.

RLOO: Ahmadian et al., "Back to Basics: Revisiting REINFORCE Style Optimization", 2024 (leave-one-out
baseline). Rewards are the contributor's functions (``rewards_loader.py``) and/or a local reward model
(``reward_model.py``, scored last), or the built-in exact answer + format, in TRL's convention
``(completions, **kwargs) -> list[float]``; completions arrive as lists of messages.
"""

from __future__ import annotations

import pathlib
import re
import tempfile
import time

import torch

from zoo_gym.evaluation.chat import prompt_messages, render_prompt_with
from zoo_gym.evaluation.evaluate import Evaluator, load_tokenizer

from .common import (TrainResult, common_training_args, load_training_model, quiet_libraries, quiet_trainer,
                     round_metadata, split_heldout)
from .config import TrainConfig, reward_weight_values
from .delta import load_base_state
from .finetuning import delta_of, prepare
from .optimizers import trainer_optimizers
from .reward_model import RewardModel
from .rewards_loader import check_reward_funcs, column_names, column_values, reward_kwargs

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


def grpo_dataset(examples: list[dict], columns: list[str] | None = None):
    """TRL's conversational prompt-only dataset: ``prompt`` plus every column of the data under its own name
    (``answer`` for records with an answer), which TRL hands each reward function as a keyword argument."""
    from datasets import Dataset

    names = column_names(examples) if columns is None else columns
    values = column_values(examples, names)
    return Dataset.from_list([{"prompt": prompt_messages(ex), **{k: values[k][i] for k in names}}
                              for i, ex in enumerate(examples)])


def mean_reward(model, tokenizer, examples: list[dict], *, max_new_tokens: int, reward_funcs=REWARD_FUNCS,
                weights: list[float] | None = None, batch_size: int = 64, columns: list[str] | None = None) -> float:
    """Mean weighted reward sum of greedy completions on ``examples`` (deterministic), rewards called as TRL does."""
    total = 0.0
    weights = weights or [1.0] * len(reward_funcs)
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
            for f, w in zip(reward_funcs, weights):
                total += w * sum(v for v in f(**reward_kwargs(chunk, texts, columns)) if v is not None)
    finally:
        tokenizer.padding_side = old_side
    return total / len(examples)


def rl_args(config: TrainConfig, output_dir: str, *, progress: bool, weights: list[float] | None):
    """TRL's RLOOConfig (stage rloo) or GRPOConfig (grpo, gspo) for ``config``."""
    from trl import GRPOConfig, RLOOConfig

    shared = dict(**common_training_args(config, output_dir, progress=progress),
                  num_generations=config.num_generations, max_completion_length=config.max_completion_length,
                  temperature=config.temperature, reward_weights=weights)
    if config.stage == "rloo":  # beta None: RLOOConfig's own (0.05, the disabled adapter is the reference)
        return RLOOConfig(**shared, **({"beta": config.beta} if config.beta is not None else {}))
    return GRPOConfig(**shared, beta=0.0 if config.beta is None else config.beta,
                      importance_sampling_level=config.importance_sampling_level, loss_type=rl_loss_type(config))


def rl_loss_type(config: TrainConfig) -> str | None:
    """The TRL loss_type a grpo/gspo round uses: the configured one, else GRPOConfig's default (dapo) for grpo
    and "grpo" for gspo (per-sequence normalisation, the GSPO paper's setup as TRL recommends); None for rloo."""
    if config.stage == "rloo":
        return None
    return config.loss_type or ("grpo" if config.stage == "gspo" else "dapo")


def _train_rl(model, tokenizer, train_ex, config: TrainConfig, funcs, weights, progress: bool, columns):
    from trl import GRPOTrainer, RLOOTrainer

    trainer_cls = RLOOTrainer if config.stage == "rloo" else GRPOTrainer
    models = [f if isinstance(f, RewardModel) else None for f in funcs]  # TRL scores a model itself
    with tempfile.TemporaryDirectory(prefix=f"zoo_gym_{config.stage}_") as tmp:
        trainer = trainer_cls(model=model, reward_funcs=[m.model if m else f for f, m in zip(funcs, models)],
                              reward_processing_classes=[m.tokenizer if m else None for m in models],
                              args=rl_args(config, tmp, progress=progress, weights=weights),
                              train_dataset=grpo_dataset(train_ex, columns), processing_class=tokenizer,
                              optimizers=trainer_optimizers(model, config))
        quiet_trainer(trainer, progress)
        trainer.train()
    return trainer


def train_grpo(base_dir, examples, config: TrainConfig, *, base_sha256: str, eval_examples=None,
               progress: bool = False):
    """One RL round (rloo, grpo or gspo) on the configured or built-in rewards; the delta and its metadata."""
    from transformers import set_seed

    train_ex, held = split_heldout(examples, eval_examples)
    custom = check_reward_funcs(config, train_ex)  # before any model loads: a bad reward fails in one line
    reward_model = RewardModel(config.reward_model) if config.reward_model else None
    funcs = (custom or []) + ([reward_model] if reward_model else []) or list(REWARD_FUNCS)
    weights = reward_weight_values(config.reward_weights)
    quiet_libraries(progress)
    set_seed(config.seed)
    base_dir = pathlib.Path(base_dir)
    held = (held or [])[: config.grpo_eval_prompts]
    names, base_state = load_base_state(base_dir)
    tokenizer = load_tokenizer(base_dir)
    tokenizer.padding_side = "left"
    model = load_training_model(base_dir, config)
    gen_len = config.max_completion_length
    columns = column_names(train_ex + held)  # every reward call gets every column, as in TRL's one table
    score = lambda m: mean_reward(m, tokenizer, held, max_new_tokens=gen_len, reward_funcs=funcs,  # noqa: E731
                                  weights=weights, columns=columns) if held else None
    answered = [ex for ex in held if "output" in ex]  # prompt-only records have no answer to measure a loss on
    reward_before = score(model)
    loss_before = Evaluator(None, answered, model=model, tokenizer=tokenizer).loss() if answered else None

    model, initial = prepare(model, config)
    t0 = time.perf_counter()
    trainer = _train_rl(model, tokenizer, train_ex, config, funcs, weights, progress, columns)
    seconds = time.perf_counter() - t0
    model = trainer.model
    model.eval()
    reward_after = score(model)
    tokenizer.padding_side = "right"
    loss_after = Evaluator(None, answered, model=model, tokenizer=tokenizer).loss() if answered else None
    train_rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]

    delta = delta_of(model, config, base_state, names, initial=initial)
    steps = int(trainer.state.global_step)
    meta = round_metadata(config, delta, base_sha256=base_sha256, **{
        "steps": steps,
        "examples_seen": steps * config.batch_size,  # completions scored
        "prompts_seen": steps * config.batch_size // config.num_generations,
        "tokens_seen": int(trainer.state.num_input_tokens_seen),
        "train_seconds": round(seconds, 3),
        "loss_before": loss_before,
        "loss_after": loss_after,
        "reward_before": reward_before,  # greedy, held-out prompts, the round's rewards (weighted sum)
        "reward_after": reward_after,
        "train_reward_first": train_rewards[0] if train_rewards else None,  # sampled, as logged by TRL
        "train_reward_last": train_rewards[-1] if train_rewards else None,
        "reward_funcs": [getattr(f, "__name__", type(f).__name__) for f in funcs],
        "reward_weights": weights,
        "reward_model": reward_model.architecture if reward_model else None,  # not its path: that is local
        "rl_trainer": "RLOOTrainer" if config.stage == "rloo" else "GRPOTrainer",
        "loss_type": rl_loss_type(config),
        "importance_sampling_level": None if config.stage == "rloo" else config.importance_sampling_level,
        "heldout_examples": len(held),
    })
    return TrainResult(delta=delta, base_sha256=base_sha256, metadata=meta)
