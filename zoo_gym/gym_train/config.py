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
STAGES = SFT_STAGES + PREFERENCE_STAGES + RL_STAGES
FINETUNING_TYPES = ("lora", "full", "freeze", "oft")
# the deprecated `method` -> (stage, finetuning_type)
METHODS = {"lora": ("sft", "lora"), "sft": ("sft", "full"), "grpo": ("grpo", "lora")}
DEVICES = ("auto", "cpu", "cuda", "mps")
REPORT_TO = {"none": None, "tensorboard": "tensorboard", "wandb": "wandb"}  # choice -> package it needs


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
    seed: int = field(default=0, metadata={"help": "seed of init, data order, dropout, sampling and DP noise",
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
    bf16: bool = field(default=False, metadata={"help": "bfloat16 mixed precision", "group": "Hardware"})
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

    @property
    def dp_enabled(self) -> bool:
        return self.dp_noise_multiplier is not None or self.dp_target_epsilon is not None

    def __post_init__(self) -> None:
        def bad(name: str, rule: str) -> None:
            raise TrainConfigError(f"`{name}` {rule}, got {getattr(self, name)!r}")

        if self.method is not None:
            if self.method not in METHODS:
                bad("method", f"must be one of {tuple(METHODS)} (deprecated: use stage and finetuning_type)")
            self.stage, self.finetuning_type = METHODS[self.method]
            self.method = None  # applied once: a later dataclasses.replace keeps the stage it sets
        if self.stage not in STAGES:
            bad("stage", f"must be one of {STAGES}")
        if self.finetuning_type not in FINETUNING_TYPES:
            bad("finetuning_type", f"must be one of {FINETUNING_TYPES}")
        if self.stage == "gspo":
            self.importance_sampling_level = "sequence"
        for name in ("max_steps", "batch_size", "gradient_accumulation_steps", "lora_r", "max_length",
                     "max_completion_length", "grpo_eval_prompts"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                bad(name, "must be an integer >= 1")
        if self.num_train_epochs is not None and not self.num_train_epochs > 0:
            bad("num_train_epochs", "must be > 0")
        if self.warmup_steps < 0:
            bad("warmup_steps", "must be >= 0")
        if not self.learning_rate > 0:
            bad("learning_rate", "must be > 0")
        if self.weight_decay < 0:
            bad("weight_decay", "must be >= 0")
        if not self.lora_alpha > 0:
            bad("lora_alpha", "must be > 0")
        if not 0.0 <= self.lora_dropout < 1.0:
            bad("lora_dropout", "must be in [0, 1)")
        if not (isinstance(self.target_modules, str) or
                (isinstance(self.target_modules, list | tuple) and self.target_modules)):
            bad("target_modules", "must be 'all-linear', a module name or a non-empty list of names")
        if self.num_generations < 2:
            bad("num_generations", "must be >= 2 (RL stages compare completions of one prompt)")
        if self.stage in RL_STAGES and self.batch_size % self.num_generations:
            bad("batch_size", f"must be a multiple of num_generations={self.num_generations} for {self.stage}")
        if self.importance_sampling_level not in ("token", "sequence"):
            bad("importance_sampling_level", "must be 'token' or 'sequence' (GSPO)")
        if not self.temperature > 0:
            bad("temperature", "must be > 0")
        if self.beta is not None and self.beta < 0:
            bad("beta", "must be >= 0")
        if self.dp_noise_multiplier is not None and self.dp_target_epsilon is not None:
            bad("dp_target_epsilon", "cannot be combined with dp_noise_multiplier (set one of them)")
        if self.dp_noise_multiplier is not None and not self.dp_noise_multiplier > 0:
            bad("dp_noise_multiplier", "must be > 0")
        if self.dp_target_epsilon is not None and not self.dp_target_epsilon > 0:
            bad("dp_target_epsilon", "must be > 0")
        if not self.dp_max_grad_norm > 0:
            bad("dp_max_grad_norm", "must be > 0")
        if not 0 < self.dp_delta < 1:
            bad("dp_delta", "must be in (0, 1)")
        if self.dp_enabled and self.stage != "sft":
            bad("stage", "cannot use DP-SGD: DP is offered for the sft stage only")
        if self.dp_enabled and self.finetuning_type not in ("lora", "full"):
            bad("finetuning_type", "cannot use DP-SGD: DP is offered for lora and full fine-tuning only")
        if self.quantization not in (None, "4bit"):
            bad("quantization", "must be None or '4bit'")
        if self.quantization == "4bit" and self.finetuning_type != "lora":
            bad("quantization", "'4bit' is QLoRA: use finetuning_type 'lora'; a 4-bit base cannot be "
                                "fine-tuned in full")
        if self.quantization == "4bit" and self.use_dora:
            bad("use_dora", "DoRA on a 4-bit base is not supported: its magnitude vector is not a low-rank delta")
        if self.device not in DEVICES:
            bad("device", f"must be one of {DEVICES}")
        if self.bf16 and self.fp16:
            bad("fp16", "cannot be combined with bf16 (choose one mixed precision)")
        if self.dp_enabled:
            for name in ("bf16", "fp16", "gradient_checkpointing"):
                if getattr(self, name):
                    bad(name, "is not offered with DP-SGD (Opacus trains in float32 without it)")
            if self.gradient_accumulation_steps != 1:
                bad("gradient_accumulation_steps", "must be 1 with DP-SGD (each step is one private batch)")
        if self.report_to not in REPORT_TO:
            bad("report_to", f"must be one of {tuple(REPORT_TO)}")
        needs = REPORT_TO[self.report_to]
        if needs is not None:
            import importlib.util

            if importlib.util.find_spec(needs) is None:
                bad("report_to", f"needs the {needs} package: pip install {needs}")
        if self.attn_implementation not in (None, "eager", "sdpa", "flash_attention_2"):
            bad("attn_implementation", "must be None, 'eager', 'sdpa' or 'flash_attention_2'")
        if self.stage in PREFERENCE_STAGES:
            from .preference_losses import loss_type_problem

            problem = loss_type_problem(self.stage, self.loss_type)
            if problem:
                bad("loss_type", problem)

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
