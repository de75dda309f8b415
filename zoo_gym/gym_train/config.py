"""Configuration of one local training round (``train``), with checks that name the field.

A round is a *stage* (what is optimised: sft, a preference loss, or an RL objective) and a
*fine-tuning type* (which weights move: lora, full, freeze, oft), in LLaMA-Factory's words; field names
are TRL's and PEFT's. The defaults are one contributor's typical federated round on the tiny model:
LoRA SFT, a few hundred short steps, well under a minute on two CPU cores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SFT_STAGES = ("sft",)
PREFERENCE_STAGES = ("dpo", "kto", "orpo", "simpo")  # learn from chosen/rejected (or KTO's labelled) answers
RL_STAGES = ("rloo", "grpo", "gspo")  # sample completions online and learn from reward functions
# TRL 1.16 GRPOConfig.loss_type's documented values (grpo and gspo); RLOOConfig has no loss_type
GRPO_LOSS_TYPES = ("grpo", "dr_grpo", "dapo", "bnpo", "cispo", "sapo", "luspo", "vespo")
BUILTIN_REWARDS = 2  # exact answer, format (grpo.py)
STAGES = SFT_STAGES + PREFERENCE_STAGES + RL_STAGES
FINETUNING_TYPES = ("lora", "full", "freeze", "oft")
# the deprecated `method` -> (stage, finetuning_type)
METHODS = {"lora": ("sft", "lora"), "sft": ("sft", "full"), "grpo": ("grpo", "lora")}
DEVICES = ("auto", "cpu", "cuda", "mps")
REPORT_TO = {"none": None, "tensorboard": "tensorboard", "wandb": "wandb"}  # choice -> package it needs
# transformers' schedules that need no extra arguments and no evaluation metric
LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup",
                 "inverse_sqrt")


class TrainConfigError(ValueError):
    """A TrainConfig field has a value that cannot work; the message names the field."""


@dataclass
class TrainConfig:
    stage: str = field(default="sft", metadata={
        "help": "what the round optimises: sft | dpo | kto | orpo | simpo (preferences) | rloo | grpo | gspo "
                "(RL on reward functions)", "group": "Training"})
    finetuning_type: str = field(default="lora", metadata={
        "help": "which weights train: lora (PEFT adapters) | full | freeze (the last freeze_trainable_layers "
                "layers in full) | oft (orthogonal fine-tuning)", "group": "Training"})
    method: str | None = field(default=None, metadata={
        "help": "deprecated: lora = --stage sft --finetuning-type lora, sft = --finetuning-type full, "
                "grpo = --stage grpo; when given it sets both", "group": "Training"})
    max_steps: int = field(default=150, metadata={"help": "optimizer steps of the round", "group": "Training"})
    num_train_epochs: float | None = field(default=None, metadata={
        "help": "passes over your training examples instead of max_steps (the client turns them into steps)",
        "group": "Training", "aliases": ("epochs",)})
    batch_size: int = field(default=16, metadata={
        "help": "examples per device step (grpo: prompts x generations)", "group": "Training",
        "aliases": ("per_device_train_batch_size",)})
    gradient_accumulation_steps: int = field(default=1, metadata={
        "help": "steps whose gradients are summed before one optimizer step", "group": "Training"})
    learning_rate: float = field(default=3e-3, metadata={"help": "peak learning rate (linear decay)",
                                                         "group": "Training", "aliases": ("lr",)})
    warmup_steps: int = field(default=5, metadata={"help": "linear warm-up steps (fewer than the round's steps)",
                                                   "group": "Training"})
    weight_decay: float = field(default=0.0, metadata={"help": "AdamW weight decay", "group": "Training"})
    max_length: int = field(default=256, metadata={"help": "tokens per example (longer ones are cut)",
                                                   "group": "Training", "aliases": ("cutoff_len",)})
    seed: int = field(default=0, metadata={"help": "seed of init, data order, dropout and sampling (DP-SGD noise and batches draw from the OS, never from it)",
                                           "group": "Training"})
    # LoRA (PEFT), used by lora and grpo
    lora_r: int = field(default=8, metadata={"help": "LoRA rank (PEFT r)", "group": "LoRA",
                                             "aliases": ("lora_rank", "r")})
    lora_alpha: float = field(default=16.0, metadata={"help": "LoRA alpha (scaling alpha/r, or alpha/sqrt(r))",
                                                      "group": "LoRA"})
    lora_dropout: float = field(default=0.0, metadata={"help": "dropout on the LoRA input", "group": "LoRA"})
    target_modules: str | list[str] = field(default="all-linear", metadata={
        "help": "PEFT target_modules: all-linear or comma-separated module names", "group": "LoRA",
        "aliases": ("lora_target",), "value_aliases": {"all": "all-linear", "all_linear": "all-linear"}})
    use_dora: bool = field(default=False, metadata={"help": "DoRA (PEFT use_dora)", "group": "LoRA"})
    use_rslora: bool = field(default=False, metadata={"help": "rank-stabilised LoRA (PEFT use_rslora)",
                                                      "group": "LoRA"})
    init_lora_weights: bool | str = field(default=True, metadata={
        "help": "PEFT init_lora_weights: true, false, gaussian, pissa, pissa_niter_N, olora ...",
        "group": "LoRA", "alias_values": {"pissa_init": {True: "pissa", False: True}}})
    merged_delta: bool = field(default=False, metadata={"help": "lora/grpo: dense merged delta instead of factors",
                                                        "group": "LoRA"})
    loraplus_lr_ratio: float | None = field(default=None, metadata={
        "help": "LoRA+: the B factors learn this many times faster than A (PEFT create_loraplus_optimizer; "
                "LLaMA-Factory's name; 16 is typical)", "group": "LoRA"})
    lora_freeze_a: bool = field(default=False, metadata={
        "help": "FFA-LoRA (Sun et al., ICLR 2024): every A factor is fixed at an init that all contributors share "
                "(drawn from the module's name) and only B trains, so a round's deltas B_i A lie in one subspace "
                "and their average is an average of B, which a robust rule keeps (docs/measurements/learning.md)",
        "group": "LoRA"})
    loftq_bits: int = field(default=4, metadata={
        "help": "init_lora_weights=loftq: bits of LoftQ's quantized base (PEFT LoftQConfig; bitsandbytes)",
        "group": "LoRA"})
    oft_block_size: int = field(default=32, metadata={
        "help": "oft: size of each orthogonal block (PEFT OFTConfig oft_block_size; divides the layer width)",
        "group": "OFT"})
    freeze_trainable_layers: int = field(default=2, metadata={
        "help": "freeze: train the last N decoder layers in full (a negative N: the first |N|)",
        "group": "Freeze"})
    freeze_trainable_modules: str = field(default="all", metadata={
        "help": "freeze: all, or comma-separated module names inside those layers (mlp,self_attn)",
        "group": "Freeze"})
    # the stage's objective (TRL's names; None takes the TRL trainer's own default for the stage)
    beta: float | None = field(default=None, metadata={
        "help": "KL / preference temperature of dpo, kto, orpo, simpo, rloo, grpo, gspo [default: the TRL "
                "trainer's, except 0 for grpo/gspo (no reference model)]", "group": "Objective",
        "aliases": ("grpo_beta", "pref_beta")})
    loss_type: str | None = field(default=None, metadata={
        "help": "the stage's TRL loss_type: dpo sigmoid | ipo | hinge | ...; grpo grpo | dr_grpo | dapo | bnpo "
                "[default: TRL's for the stage]", "group": "Objective", "aliases": ("pref_loss",)})
    # RL stages (TRL GRPOTrainer / RLOOTrainer)
    num_generations: int = field(default=8, metadata={"help": "rloo/grpo/gspo: completions per prompt",
                                                      "group": "RL", "aliases": ("grpo_num_generations",)})
    max_completion_length: int = field(default=6, metadata={
        "help": "rloo/grpo/gspo: tokens generated per completion", "group": "RL",
        "aliases": ("grpo_max_completion_length",)})
    temperature: float = field(default=1.0, metadata={"help": "rloo/grpo/gspo: sampling temperature",
                                                      "group": "RL", "aliases": ("grpo_temperature",)})
    importance_sampling_level: str = field(default="token", metadata={
        "help": "grpo: token | sequence (sequence is GSPO; --stage gspo sets it)", "group": "RL",
        "aliases": ("grpo_importance_sampling_level",)})
    grpo_eval_prompts: int = field(default=64, metadata={"help": "rloo/grpo/gspo: prompts for reward_before/after",
                                                         "group": "RL"})
    reward_funcs: str | list[str] | None = field(default=None, metadata={
        "help": "RL stages: reward functions as path/to/file.py:name or module:name, comma-separated [default: the "
                "built-in exact-answer and format rewards]", "group": "RL",
        "aliases": ("reward_function", "reward_functions")})
    reward_model: str | None = field(default=None, metadata={
        "help": "RL stages: a local directory with a reward model (a sequence-classification checkpoint with one "
                "label and its tokenizer, as TRL takes in reward_funcs; nothing is downloaded), alone or scored "
                "after reward_funcs", "group": "RL", "aliases": ("reward_model_path",)})
    reward_weights: str | list[str] | None = field(default=None, metadata={
        "help": "RL stages: one weight per reward function (reward_funcs, then reward_model), comma-separated "
                "(TRL reward_weights) [default: 1 each]", "group": "RL"})
    # Optimizer (transformers TrainingArguments' names, LLaMA-Factory's as aliases)
    optim: str = field(default="adamw_torch", metadata={
        "help": "adamw_torch | any transformers optim name (sgd, adafactor, galore_adamw, apollo_adamw ...) | "
                "adam_mini | muon | badam (their packages: zoo-gym's optimizers extra)", "group": "Optimizer",
        "alias_values": {"use_galore": {True: "galore_adamw", False: "adamw_torch"},
                         "use_apollo": {True: "apollo_adamw", False: "adamw_torch"},
                         "use_adam_mini": {True: "adam_mini", False: "adamw_torch"},
                         "use_muon": {True: "muon", False: "adamw_torch"},
                         "use_badam": {True: "badam", False: "adamw_torch"}}})
    optim_target_modules: str | list[str] = field(default="all-linear", metadata={
        "help": "galore/apollo: the modules whose weights get the low-rank optimizer (all-linear or names)",
        "group": "Optimizer", "aliases": ("galore_target", "apollo_target")})
    neftune_noise_alpha: float | None = field(default=None, metadata={
        "help": "NEFTune: uniform noise of this alpha on the input embeddings while training (sft)",
        "group": "Optimizer"})
    use_liger_kernel: bool = field(default=False, metadata={
        "help": "Liger's fused Triton kernels (CUDA and the liger-kernel package)", "group": "Optimizer",
        "aliases": ("enable_liger_kernel",)})
    use_unsloth: bool = field(default=False, metadata={
        "help": "load and train through Unsloth (CUDA and the unsloth package)", "group": "Optimizer"})
    flash_attn: str = field(default="auto", metadata={
        "help": "LLaMA-Factory's attention switch: auto | disabled (eager) | sdpa | fa2 (flash_attention_2, CUDA); "
                "sets attn_implementation", "group": "Optimizer"})
    # DP-SGD (Opacus), sft and lora
    dp_noise_multiplier: float | None = field(default=None, metadata={"help": "Gaussian noise / max_grad_norm",
                                                                      "group": "Differential privacy"})
    dp_max_grad_norm: float = field(default=1.0, metadata={"help": "per-example gradient clip",
                                                           "group": "Differential privacy"})
    dp_target_epsilon: float | None = field(default=None, metadata={"help": "noise chosen to spend this epsilon",
                                                                    "group": "Differential privacy"})
    dp_delta: float = field(default=1e-5, metadata={"help": "DP delta", "group": "Differential privacy"})
    # hardware
    device: str = field(default="auto", metadata={"help": "auto (a CUDA GPU when present) | cpu | cuda | mps",
                                                  "group": "Hardware"})
    bf16: bool = field(default=False, metadata={
        "help": "bfloat16 mixed precision (with LoRA the frozen base is loaded in bfloat16)", "group": "Hardware"})
    fp16: bool = field(default=False, metadata={"help": "float16 mixed precision (CUDA only)", "group": "Hardware"})
    gradient_checkpointing: bool = field(default=False, metadata={
        "help": "recompute activations in the backward pass (less memory, slower)", "group": "Hardware"})
    quantization: str | None = field(default=None, metadata={"help": "None | '4bit' (QLoRA, bitsandbytes NF4)",
                                                             "group": "Hardware"})
    attn_implementation: str | None = field(default=None, metadata={
        "help": "None | sdpa | eager | flash_attention_2", "group": "Hardware"})
    report_to: str = field(default="none", metadata={
        "help": "none | tensorboard | wandb: also send TRL's training curves there (tensorboard writes under "
                "$TENSORBOARD_LOGGING_DIR, default ./runs)", "group": "Training"})
    # the HF Trainer's own settings (TRL's and LLaMA-Factory's names); checked in _check_trainer
    lr_scheduler_type: str = field(default="linear", metadata={
        "help": f"learning-rate schedule after warm-up: {' | '.join(LR_SCHEDULERS)} (transformers'; DP-SGD: "
                "linear only)", "group": "Trainer"})
    warmup_ratio: float | None = field(default=None, metadata={
        "help": "warm-up as a fraction of the round's steps, ceil(ratio x steps) as transformers counts it; "
                "when set it replaces warmup_steps (give one of them)", "group": "Trainer"})
    max_grad_norm: float = field(default=1.0, metadata={
        "help": "clip the batch gradient's norm to this (transformers'; DP-SGD clips per example at "
                "dp_max_grad_norm instead)", "group": "Trainer"})
    max_samples: int | None = field(default=None, metadata={
        "help": "use at most this many of your examples (the first ones; LLaMA-Factory's max_samples) "
                "[default: all]", "group": "Trainer"})
    packing: bool = field(default=False, metadata={
        "help": "sft: pack several short examples into each max_length row (TRL's packing)", "group": "Trainer"})
    assistant_only_loss: bool = field(default=True, metadata={
        "help": "sft: the loss is on the answer (the assistant's completion) only; false: on the prompt's "
                "tokens too (plain text records always train on every token). TRL's completion_only_loss; "
                "LLaMA-Factory's train_on_prompt is its opposite", "group": "Trainer",
        "aliases": ("completion_only_loss",), "alias_values": {"train_on_prompt": {True: False, False: True}}})
    logging_steps: int | None = field(default=None, metadata={
        "help": "log the loss every this many steps [default: a tenth of the round's steps]",
        "group": "Trainer"})

    @property
    def dp_enabled(self) -> bool:
        return self.dp_noise_multiplier is not None or self.dp_target_epsilon is not None

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> None:
            raise TrainConfigError(f"`{name}` {rule}, got {getattr(self, name)!r}")

        from .optimizers import check_options  # Optimizer, LoRA+, LoftQ, OFT and freeze fields

        for check in (_apply_stage, _check_numbers, _check_objective, _check_privacy, _check_hardware,
                      check_options, _check_trainer):
            check(self, bad)
        check_rl_settings(self)

    def warmup_for(self, steps: int) -> int:
        """Warm-up steps of a round of ``steps`` optimizer steps: ceil(warmup_ratio x steps) when the ratio
        is set (as transformers counts it), else warmup_steps."""
        return math.ceil(steps * self.warmup_ratio) if self.warmup_ratio is not None else self.warmup_steps

    @property
    def label(self) -> str:
        """'sft+lora', 'dpo+full', ...: the round's stage and fine-tuning type in one word."""
        return f"{self.stage}+{self.finetuning_type}"

    def identity(self) -> dict:
        """What a round's metadata says about how it trained (read by the server's round report)."""
        return {"method": self.label, "stage": self.stage, "finetuning_type": self.finetuning_type}

    def steps_for(self, n_examples: int) -> int:
        """Optimizer steps of a round over ``n_examples`` training examples (as the HF Trainer counts them:
        batches per epoch // gradient_accumulation_steps, times the epochs); ``max_steps`` without epochs."""
        if self.num_train_epochs is None:
            return self.max_steps
        per_step = self.batch_size // self.num_generations if self.stage in RL_STAGES else self.batch_size
        batches = math.ceil(n_examples / max(1, per_step))
        return max(1, math.ceil(self.num_train_epochs * max(1, batches // self.gradient_accumulation_steps)))


def _apply_stage(cfg: TrainConfig, bad) -> None:
    """The deprecated `method` as stage and fine-tuning type; both checked; gspo's sampling level."""
    if cfg.method is not None:
        if cfg.method not in METHODS:
            bad("method", f"must be one of {tuple(METHODS)} (deprecated: use stage and finetuning_type)")
        cfg.stage, cfg.finetuning_type = METHODS[cfg.method]
        cfg.method = None  # applied once: a later dataclasses.replace keeps the stage it sets
    if cfg.stage not in STAGES:
        bad("stage", f"must be one of {STAGES}" + (" (ppo is not offered: TRL 1.16 ships no PPO trainer; rloo, "
                                                   "grpo and gspo take a reward_model; see "
                                                   "docs/design/training-stages.md)" if cfg.stage == "ppo" else ""))
    if cfg.finetuning_type not in FINETUNING_TYPES:
        bad("finetuning_type", f"must be one of {FINETUNING_TYPES}")
    if cfg.stage == "gspo":
        cfg.importance_sampling_level = "sequence"


def _check_numbers(cfg: TrainConfig, bad) -> None:
    """Step counts, sizes and rates of the round."""
    for name in ("max_steps", "batch_size", "gradient_accumulation_steps", "lora_r", "max_length",
                 "max_completion_length", "grpo_eval_prompts"):
        if not isinstance(getattr(cfg, name), int) or getattr(cfg, name) < 1:
            bad(name, "must be an integer >= 1")
    if cfg.num_train_epochs is not None and not cfg.num_train_epochs > 0:
        bad("num_train_epochs", "must be > 0")
    if cfg.warmup_steps < 0:
        bad("warmup_steps", "must be >= 0")
    if not cfg.learning_rate > 0:
        bad("learning_rate", "must be > 0")
    if cfg.weight_decay < 0:
        bad("weight_decay", "must be >= 0")
    if not cfg.lora_alpha > 0:
        bad("lora_alpha", "must be > 0")
    if not 0.0 <= cfg.lora_dropout < 1.0:
        bad("lora_dropout", "must be in [0, 1)")
    if not (isinstance(cfg.target_modules, str) or
            (isinstance(cfg.target_modules, list | tuple) and cfg.target_modules)):
        bad("target_modules", "must be 'all-linear', a module name or a non-empty list of names")


def _check_objective(cfg: TrainConfig, bad) -> None:
    """The RL and preference stages' objective settings."""
    if cfg.num_generations < 2:
        bad("num_generations", "must be >= 2 (RL stages compare completions of one prompt)")
    if cfg.stage in RL_STAGES and cfg.batch_size % cfg.num_generations:
        bad("batch_size", f"must be a multiple of num_generations={cfg.num_generations} for {cfg.stage}")
    if cfg.importance_sampling_level not in ("token", "sequence"):
        bad("importance_sampling_level", "must be 'token' or 'sequence' (GSPO)")
    if not cfg.temperature > 0:
        bad("temperature", "must be > 0")
    if cfg.beta is not None and cfg.beta < 0:
        bad("beta", "must be >= 0")
    if cfg.stage in PREFERENCE_STAGES:
        from .preference_losses import loss_type_problem

        problem = loss_type_problem(cfg.stage, cfg.loss_type)
        if problem:
            bad("loss_type", problem)


def _check_privacy(cfg: TrainConfig, bad) -> None:
    """DP-SGD's settings, and what DP-SGD cannot be combined with."""
    if cfg.dp_noise_multiplier is not None and cfg.dp_target_epsilon is not None:
        bad("dp_target_epsilon", "cannot be combined with dp_noise_multiplier (set one of them)")
    if cfg.dp_noise_multiplier is not None and not cfg.dp_noise_multiplier > 0:
        bad("dp_noise_multiplier", "must be > 0")
    if cfg.dp_target_epsilon is not None and not cfg.dp_target_epsilon > 0:
        bad("dp_target_epsilon", "must be > 0")
    if not cfg.dp_max_grad_norm > 0:
        bad("dp_max_grad_norm", "must be > 0")
    if not 0 < cfg.dp_delta < 1:
        bad("dp_delta", "must be in (0, 1)")
    if cfg.dp_enabled and cfg.stage != "sft":
        bad("stage", "cannot use DP-SGD: DP is offered for the sft stage only")
    if cfg.dp_enabled and cfg.finetuning_type not in ("lora", "full"):
        bad("finetuning_type", "cannot use DP-SGD: DP is offered for lora and full fine-tuning only")
    if cfg.dp_enabled:
        for name in ("bf16", "fp16", "gradient_checkpointing"):
            if getattr(cfg, name):
                bad(name, "is not offered with DP-SGD (Opacus trains in float32 without it)")
        if cfg.gradient_accumulation_steps != 1:
            bad("gradient_accumulation_steps", "must be 1 with DP-SGD (each step is one private batch)")


def _check_hardware(cfg: TrainConfig, bad) -> None:
    """Quantization, device, precision, reporting and attention settings."""
    if cfg.quantization not in (None, "4bit"):
        bad("quantization", "must be None or '4bit'")
    if cfg.quantization == "4bit" and cfg.finetuning_type != "lora":
        bad("quantization", "'4bit' is QLoRA: use finetuning_type 'lora'; a 4-bit base cannot be "
                            "fine-tuned in full")
    if cfg.quantization == "4bit" and cfg.use_dora:
        bad("use_dora", "DoRA on a 4-bit base is not supported: its magnitude vector is not a low-rank delta")
    if cfg.device not in DEVICES:
        bad("device", f"must be one of {DEVICES}")
    if cfg.bf16 and cfg.fp16:
        bad("fp16", "cannot be combined with bf16 (choose one mixed precision)")
    if cfg.report_to not in REPORT_TO:
        bad("report_to", f"must be one of {tuple(REPORT_TO)}")
    needs = REPORT_TO[cfg.report_to]
    if needs is not None:
        import importlib.util

        if importlib.util.find_spec(needs) is None:
            bad("report_to", f"needs the {needs} package: pip install {needs}")
    if cfg.attn_implementation not in (None, "eager", "sdpa", "flash_attention_2"):
        bad("attn_implementation", "must be None, 'eager', 'sdpa' or 'flash_attention_2'")


def _check_trainer(config: TrainConfig, bad) -> None:
    """The Trainer group's checks (``bad(name, rule)`` raises TrainConfigError naming the field)."""
    if config.lr_scheduler_type not in LR_SCHEDULERS:
        bad("lr_scheduler_type", f"must be one of {LR_SCHEDULERS}")
    if config.dp_enabled and config.lr_scheduler_type != "linear":
        bad("lr_scheduler_type", "must be 'linear' with DP-SGD (its own optimizer loop decays linearly)")
    if config.warmup_ratio is not None and not 0 <= config.warmup_ratio < 1:
        bad("warmup_ratio", "must be in [0, 1)")
    if not config.max_grad_norm > 0:
        bad("max_grad_norm", "must be > 0")
    for name in ("max_samples", "logging_steps"):
        value = getattr(config, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            bad(name, "must be an integer >= 1 (or unset)")
    if config.packing and config.stage != "sft":
        bad("packing", "applies to the sft stage only")
    if config.packing and config.dp_enabled:
        bad("packing", "is not offered with DP-SGD (one private example per row)")


def reward_func_specs(value: str | list[str] | None) -> list[str]:
    """The reward function specs of ``reward_funcs`` (comma-separated text or a list), in order."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else list(value)
    return [str(v).strip() for v in items if str(v).strip()]


def reward_weight_values(value: str | list | None) -> list[float] | None:
    """``reward_weights`` as floats (comma-separated text or a list), or None; ValueError on a non-number."""
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else list(value)
    return [float(v) for v in items if str(v).strip()]


def check_rl_settings(cfg: TrainConfig) -> None:
    """The RL stages' loss_type, reward_funcs and reward_weights, one line naming the field."""
    if cfg.stage == "rloo" and cfg.loss_type is not None:
        raise TrainConfigError(f"`loss_type` is not used by rloo (TRL's RLOOConfig has none; grpo/gspo take "
                               f"{', '.join(GRPO_LOSS_TYPES)}), got {cfg.loss_type!r}")
    if cfg.stage in ("grpo", "gspo") and cfg.loss_type is not None and cfg.loss_type not in GRPO_LOSS_TYPES:
        raise TrainConfigError(f"`loss_type` for {cfg.stage} must be one of {', '.join(GRPO_LOSS_TYPES)} "
                               f"(TRL GRPOConfig), got {cfg.loss_type!r}")
    if cfg.reward_model is not None and (not isinstance(cfg.reward_model, str) or not cfg.reward_model.strip()):
        raise TrainConfigError(f"`reward_model` must be the path of a local directory, got {cfg.reward_model!r}")
    if cfg.reward_funcs is None and cfg.reward_weights is None:
        return  # (like the other RL settings, they are unused by the other stages)
    if not isinstance(cfg.reward_funcs, str | list | tuple | type(None)):
        raise TrainConfigError(f"`reward_funcs` must be text or a list of texts, got {cfg.reward_funcs!r}")
    specs = reward_func_specs(cfg.reward_funcs)
    if cfg.reward_funcs is not None and not specs:
        raise TrainConfigError("`reward_funcs` is empty: give path/to/file.py:name or module:name")
    for spec in specs:
        path, sep, name = spec.rpartition(":")
        if not sep or not path or not name.isidentifier():
            raise TrainConfigError(f"`reward_funcs` entry {spec!r} must be path/to/file.py:name or module:name")
    try:
        weights = reward_weight_values(cfg.reward_weights)
    except (TypeError, ValueError):
        raise TrainConfigError(f"`reward_weights` must be numbers, comma-separated, got {cfg.reward_weights!r}"
                               ) from None
    n = len(specs) + (cfg.reward_model is not None) or BUILTIN_REWARDS
    if weights is not None and len(weights) != n:
        raise TrainConfigError(f"`reward_weights` needs one weight per reward function ({n}"
                               f"{', the reward model last' if cfg.reward_model is not None else ''}), "
                               f"got {len(weights)}")


# Where a learning rate stops looking like a choice and starts looking like a slip (a warning, never a refusal).
# The reference is this module's own default, 3e-3, tuned for LoRA SFT rounds on the tiny model and used by the
# RL stages' tests (up to 1e-2): 10x it is the usual ceiling. The preference stages and full fine-tuning get a
# tenth of that ceiling: TRL 1.16's DPOConfig/KTOConfig default to 1e-6 where SFTConfig defaults to 2e-5 (a
# preference loss is pushed ~20x more gently), and full fine-tuning's usual rates are about a tenth of LoRA's
# (TRL's PEFT guide: 1e-4..2e-4 for LoRA against 1e-5..2e-5 in full). Not compounded: the default never warns.
LR_WARN_FACTOR = 10.0
LR_GENTLE_FACTOR = 0.1


def usual_max_learning_rate(stage: str, finetuning_type: str) -> float:
    """The highest learning rate still in ``stage``'s usual range for ``finetuning_type`` (see above)."""
    default = TrainConfig.__dataclass_fields__["learning_rate"].default
    gentle = stage in PREFERENCE_STAGES or finetuning_type == "full"
    return default * LR_WARN_FACTOR * (LR_GENTLE_FACTOR if gentle else 1.0)


def learning_rate_warning(stage: str, finetuning_type: str, learning_rate: float) -> str | None:
    """One line when ``learning_rate`` is far above the stage's usual range, else None."""
    ceiling = usual_max_learning_rate(stage, finetuning_type)
    if not isinstance(learning_rate, int | float) or learning_rate <= ceiling:
        return None
    return (f"learning_rate {learning_rate:g} is {learning_rate / ceiling:.3g}x the top of the usual range for "
            f"{finetuning_type} {stage} ({ceiling:g}): a round this hot can undo what the model learned before, "
            "for every contributor; lower it unless you mean it")
