"""What every local training path (SFT/LoRA in train.py, DP-SGD in dp.py, GRPO in grpo.py) shares.

The result type, the held-out split, library quieting, the LoRA config, the TrainingArguments
common to TRL's trainers, and loading the model to train. Nothing here imports the paths themselves.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import dataclass, field

import torch

from zoo_gym.evaluation.evaluate import load_model

from .config import TrainConfig
from .delta import capture_initial_factors
from .hardware import torch_device
from .optimizers import training_args as optimizer_training_args


@dataclass
class TrainResult:
    delta: dict  # base parameter name -> Tensor (dense) or zoo_gym.codec.LoraFactors
    base_sha256: str
    metadata: dict = field(default_factory=dict)


def round_metadata(config: TrainConfig, delta: dict, *, base_sha256: str, **measured) -> dict:
    """What every round reports: how it trained (stage, type, LoRA shape), the base, the seed, the delta's
    form, no DP unless ``measured`` says otherwise, then the stage's own ``measured`` figures."""
    meta = {**config.identity(), "epsilon": None, "dp_delta": None, "base_sha256": base_sha256,
            "seed": config.seed,
            "delta_format": "dense" if isinstance(next(iter(delta.values())), torch.Tensor) else "lora_factors"}
    if config.finetuning_type == "lora":
        meta.update(lora_r=config.lora_r, lora_alpha=config.lora_alpha, use_dora=config.use_dora,
                    use_rslora=config.use_rslora, init_lora_weights=config.init_lora_weights,
                    quantization=config.quantization)
    meta.update(measured)
    return meta


def quiet_libraries(progress: bool) -> None:
    """Hide library deprecation notices; without progress, also transformers' and datasets' logs and bars."""
    import warnings

    import datasets
    import transformers

    # transformers/TRL/PEFT deprecation notices (FutureWarning) are for us, not for a contributor's terminal
    warnings.filterwarnings("ignore", category=FutureWarning)
    if progress:
        return
    if transformers.utils.logging.get_verbosity() >= transformers.utils.logging.WARNING:  # not raised by --log-level
        transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    datasets.utils.logging.set_verbosity_error()
    datasets.disable_progress_bars()


def split_heldout(examples: list[dict], eval_examples: list[dict] | None) -> tuple[list[dict], list[dict] | None]:
    """Without explicit eval examples, hold out the last tenth (at most 64) of the data when there are >= 10."""
    if eval_examples is not None:
        return examples, list(eval_examples) or None
    if len(examples) < 10:
        return examples, None
    k = min(64, len(examples) // 10)
    return examples[:-k], examples[-k:]


def lora_config(cfg: TrainConfig):
    """PEFT's LoraConfig for ``cfg`` (a causal LM, no bias training)."""
    from peft import LoftQConfig, LoraConfig

    loftq = LoftQConfig(loftq_bits=cfg.loftq_bits) if cfg.init_lora_weights == "loftq" else {}
    return LoraConfig(
        r=cfg.lora_r,
        lora_alpha=cfg.lora_alpha,
        lora_dropout=cfg.lora_dropout,
        target_modules=cfg.target_modules,
        use_dora=cfg.use_dora,
        use_rslora=cfg.use_rslora,
        init_lora_weights=cfg.init_lora_weights,
        loftq_config=loftq,
        bias="none",
        task_type="CAUSAL_LM",
    )


def common_training_args(cfg: TrainConfig, output_dir: str, *, progress: bool) -> dict:
    """Keyword arguments shared by SFTConfig and GRPOConfig (transformers TrainingArguments)."""
    if cfg.report_to == "tensorboard":  # the run's output_dir is a temporary directory: keep the curves
        os.environ.setdefault("TENSORBOARD_LOGGING_DIR", os.path.abspath("runs"))
    return dict(
        output_dir=output_dir,
        max_steps=cfg.max_steps,
        per_device_train_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        learning_rate=cfg.learning_rate,
        lr_scheduler_type=cfg.lr_scheduler_type,
        warmup_steps=cfg.warmup_for(cfg.max_steps),  # a warmup_ratio as steps, counted as transformers does
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm,
        logging_steps=cfg.logging_steps or max(1, cfg.max_steps // 10),
        save_strategy="no",
        report_to=cfg.report_to,  # tensorboard: $TENSORBOARD_LOGGING_DIR, else ./runs (set in train())
        use_cpu=torch_device(cfg).type == "cpu",
        bf16=cfg.bf16,
        fp16=cfg.fp16,
        seed=cfg.seed,
        data_seed=cfg.seed,
        disable_tqdm=not progress,
        log_level="warning" if progress else "error",  # not the "share your model on huggingface.co" line
        dataloader_num_workers=0,
        include_num_input_tokens_seen="non_padding",
        gradient_checkpointing=cfg.gradient_checkpointing,  # TRL defaults it on; the tiny model needs no memory saving
        **optimizer_training_args(cfg),  # optim, NEFTune, Liger (a custom optimizer: trainer_optimizers)
    )


def quiet_trainer(trainer, progress: bool) -> None:
    """Without progress, drop the callbacks that print every log dict to stdout and draw the bar, and
    print a step/loss/ETA line at least every 10 s instead (zoo_gym/gym_train/heartbeat.py)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    from zoo_gym.gym_train.heartbeat import Heartbeat, training_bar

    trainer.remove_callback(PrinterCallback)  # raw log dicts
    trainer.remove_callback(ProgressCallback)  # writes every log dict under its bar
    trainer.add_callback(training_bar() if progress else Heartbeat())


def with_lora(model, config: TrainConfig):
    """(PEFT model, initial factors): the initial factors are kept only for inits where B0 @ A0 != 0
    (PiSSA, OLoRA ...), whose delta must subtract them (see delta.lora_factors)."""
    from peft import get_peft_model

    model = get_peft_model(model, lora_config(config))
    initial = capture_initial_factors(model) if config.init_lora_weights not in (True, False, "gaussian") else None
    if config.lora_freeze_a:
        freeze_shared_lora_a(model)
    return model, initial


def freeze_shared_lora_a(model) -> int:
    """FFA-LoRA: set every ``lora_A`` weight to PEFT's default init (uniform in +-1/sqrt(fan_in), as its
    kaiming-uniform with a = sqrt(5) gives) drawn from a generator seeded by the parameter's name, so every
    contributor of the same model holds the same A, and freeze it. B starts at 0, so the delta is still B A.
    Written here because PEFT has no option for a shared, frozen A. Returns how many factors were frozen."""
    frozen = 0
    for name, p in model.named_parameters():
        if ".lora_A." not in name:
            continue
        seed = int.from_bytes(hashlib.sha256(b"zoo-gym/ffa-lora-A/v1\n" + name.encode()).digest()[:8], "big")
        g = torch.Generator().manual_seed(seed)
        bound = 1.0 / math.sqrt(p.shape[1])
        with torch.no_grad():
            p.copy_(((torch.rand(p.shape, generator=g) * 2 - 1) * bound).to(p.dtype))
        p.requires_grad_(False)
        frozen += 1
    return frozen


# TRL 1.16's fused output layer (trl.trainer.utils, in every TRL trainer) projects the vocabulary in chunks of
# 32768 rows, and on the CPU its backward copies each chunk to float32 (on CUDA addmm writes float32 without a
# copy): 134 MB at Qwen3-0.6B's width, 537 MB at 8B's, the peak of a short LoRA step. TRL has no setting for
# it, so CPU training uses chunks of CPU_HEAD_CHUNK_ROWS (gym-server init at 0.6B: 1.22 -> 1.08 GB; README).
CPU_HEAD_CHUNK_ROWS = 8192


def fit_head_chunks(device: torch.device) -> None:
    """TRL's vocabulary chunk: CPU_HEAD_CHUNK_ROWS on the CPU, TRL's own elsewhere (see above)."""
    import trl.trainer.utils as trl_utils

    own = getattr(trl_utils, "_CHUNKED_LOGPROB_CHUNK_SIZE", None)
    if not isinstance(own, int):
        return  # another TRL: its own chunking
    trl_default = fit_head_chunks.__dict__.setdefault("trl_default", own)
    trl_utils._CHUNKED_LOGPROB_CHUNK_SIZE = (min(CPU_HEAD_CHUNK_ROWS, trl_default) if device.type == "cpu"
                                             else trl_default)


def load_training_model(base_dir, config: TrainConfig):
    """The base model to train: 4-bit NF4 for QLoRA (prepared for k-bit training); bfloat16 for LoRA with
    `bf16` (the frozen base at half the memory; the adapters stay float32); else float32."""
    fit_head_chunks(torch_device(config))
    if config.use_unsloth:  # Unsloth patches transformers and TRL when imported (CUDA only: check_hardware)
        import importlib

        importlib.import_module("unsloth")
    if config.quantization == "4bit":
        from peft import prepare_model_for_kbit_training

        from .qlora import load_4bit_model

        model = load_4bit_model(base_dir, attn_implementation=config.attn_implementation)
        return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    frozen_bf16 = config.bf16 and config.finetuning_type == "lora" and not config.dp_enabled
    return load_model(base_dir, dtype=torch.bfloat16 if frozen_bf16 else torch.float32,
                      attn_implementation=config.attn_implementation)
