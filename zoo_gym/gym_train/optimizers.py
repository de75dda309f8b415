"""The round's optimizer and training tricks: checks of the Optimizer fields, TrainingArguments for them, and
the optimizer a stage hands its TRL trainer (``optimizers=trainer_optimizers(model, cfg)``).

transformers' own ``optim`` names (adamw_torch, sgd, galore_adamw, apollo_adamw ...) go through
TrainingArguments; ``adam_mini``, ``muon`` (torch.optim.Muon on the 2-D hidden weights, AdamW on the rest),
``badam`` (BAdam's BlockOptimizer over the decoder layers) and LoRA+ are built here. Imports nothing from
gym_train, so config.py can call ``check_options`` at the end of its checks.
"""

from __future__ import annotations

import importlib.util
import math
import re
import warnings

import torch

CUSTOM = ("adam_mini", "muon", "badam")  # built here, not by transformers
FULL_ONLY = ("galore", "apollo", *CUSTOM)  # optimizers of the base weights themselves
PACKAGES = {"galore": "galore_torch", "apollo": "apollo_torch", "adam_mini": "adam_mini", "badam": "badam"}
FLASH_ATTN = {"disabled": "eager", "sdpa": "sdpa", "fa2": "flash_attention_2"}  # LLaMA-Factory -> transformers
INSTALL = "pip install 'zoo-gym[optimizers]'"


def _family(optim: str) -> str:
    return next((f for f in PACKAGES if optim.startswith(f)), optim)


def _known_optim(optim: str) -> bool:
    if optim in CUSTOM:
        return True
    from transformers.training_args import OptimizerNames

    return optim in {o.value for o in OptimizerNames}


def check_options(cfg, bad) -> None:
    """TrainConfigError (through ``bad(field, rule)``) for Optimizer, LoRA+, LoftQ, OFT and freeze settings."""
    if cfg.loraplus_lr_ratio is not None and not cfg.loraplus_lr_ratio > 0:
        bad("loraplus_lr_ratio", "must be > 0")
    if cfg.loraplus_lr_ratio is not None and cfg.finetuning_type != "lora":
        bad("loraplus_lr_ratio", "is LoRA+: use finetuning_type 'lora'")
    if cfg.lora_freeze_a and (cfg.finetuning_type != "lora" or cfg.init_lora_weights is not True or cfg.use_dora
                              or cfg.loraplus_lr_ratio is not None):
        bad("lora_freeze_a", "(FFA-LoRA) needs finetuning_type 'lora' with the default init, no DoRA and no LoRA+")
    if cfg.loftq_bits not in (4, 8):
        bad("loftq_bits", "must be 4 or 8 (bitsandbytes' LoftQ quantizers)")
    if cfg.init_lora_weights == "loftq" and (cfg.finetuning_type != "lora" or cfg.quantization or cfg.use_dora):
        bad("init_lora_weights", "'loftq' needs finetuning_type 'lora' on an unquantized base without DoRA")
    if not isinstance(cfg.oft_block_size, int) or cfg.oft_block_size < 1:
        bad("oft_block_size", "must be an integer >= 1")
    if not isinstance(cfg.freeze_trainable_layers, int) or cfg.freeze_trainable_layers == 0:
        bad("freeze_trainable_layers", "must be a non-zero integer (the last N layers, or the first |N| if < 0)")
    if not str(cfg.freeze_trainable_modules).strip(" ,"):
        bad("freeze_trainable_modules", "must be 'all' or comma-separated module names")
    if cfg.neftune_noise_alpha is not None and not cfg.neftune_noise_alpha > 0:
        bad("neftune_noise_alpha", "must be > 0")
    _check_optim(cfg, bad)
    if cfg.flash_attn not in ("auto", *FLASH_ATTN):
        bad("flash_attn", f"must be one of {('auto', *FLASH_ATTN)}")
    if cfg.flash_attn != "auto":
        impl = FLASH_ATTN[cfg.flash_attn]
        if cfg.attn_implementation not in (None, impl):
            bad("flash_attn", f"asks for {impl} but attn_implementation is {cfg.attn_implementation!r}")
        cfg.attn_implementation = impl


def _check_optim(cfg, bad) -> None:
    optim, family = cfg.optim, _family(cfg.optim)
    if optim == "adamw_torch":
        if cfg.dp_enabled and cfg.loraplus_lr_ratio is not None:
            bad("loraplus_lr_ratio", "is not offered with DP-SGD (Opacus owns the optimizer)")
        return
    if not _known_optim(optim):
        bad("optim", f"must be a transformers optim name or one of {CUSTOM}")
    if cfg.dp_enabled:
        bad("optim", "must be adamw_torch with DP-SGD (Opacus owns the optimizer)")
    if family in FULL_ONLY and cfg.finetuning_type != "full":
        bad("optim", f"{optim!r} optimizes the base weights themselves: use finetuning_type 'full'")
    if cfg.loraplus_lr_ratio is not None and optim in CUSTOM:
        bad("loraplus_lr_ratio", f"builds its own AdamW: it cannot be combined with optim {optim!r}")
    if family in PACKAGES and importlib.util.find_spec(PACKAGES[family]) is None:
        bad("optim", f"needs the {PACKAGES[family].replace('_', '-')} package: {INSTALL}")
    if optim == "muon" and not hasattr(torch.optim, "Muon"):
        bad("optim", f"'muon' needs torch.optim.Muon (PyTorch >= 2.9), this is torch {torch.__version__}")
    if "layerwise" in optim and cfg.gradient_accumulation_steps != 1:
        bad("optim", "layerwise GaLore/APOLLO steps inside backward: gradient_accumulation_steps must be 1")


def training_args(cfg) -> dict:
    """The TrainingArguments keywords of the Optimizer fields (a custom optimizer is passed to the trainer)."""
    out = dict(optim="adamw_torch" if cfg.optim in CUSTOM else cfg.optim,
               neftune_noise_alpha=cfg.neftune_noise_alpha, use_liger_kernel=cfg.use_liger_kernel)
    if _family(cfg.optim) in ("galore", "apollo"):
        out["optim_target_modules"] = cfg.optim_target_modules
    return out


def trainer_optimizers(model, cfg) -> tuple:
    """``(optimizer or None, None)`` for a Trainer's ``optimizers=``: None lets TrainingArguments' optim build it."""
    if cfg.loraplus_lr_ratio is not None:
        from peft.optimizers import create_loraplus_optimizer

        opt = create_loraplus_optimizer(model, torch.optim.AdamW, lr=cfg.learning_rate,
                                        loraplus_lr_ratio=cfg.loraplus_lr_ratio, weight_decay=cfg.weight_decay)
        return opt, None
    build = {"adam_mini": _adam_mini, "muon": _muon, "badam": _badam}.get(cfg.optim)
    return (build(model, cfg) if build else None), None


def _adam_mini(model, cfg):
    from adam_mini import Adam_mini

    c = model.config
    return Adam_mini(named_parameters=model.named_parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                     model_sharding=False, dim=c.hidden_size, n_heads=c.num_attention_heads,
                     n_kv_heads=getattr(c, "num_key_value_heads", None), verbose=False)


def _muon(model, cfg):
    """Muon on the 2-D weights inside the decoder layers, AdamW on embeddings, norms and the head."""
    hidden, rest = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (hidden if p.ndim == 2 and re.search(r"\.layers\.\d+\.", name) else rest).append(p)
    muon = torch.optim.Muon(hidden, lr=cfg.learning_rate, weight_decay=cfg.weight_decay,
                            adjust_lr_fn="match_rms_adamw")  # AdamW's learning rate fits both
    return Chained([muon, torch.optim.AdamW(rest, lr=cfg.learning_rate, weight_decay=cfg.weight_decay)])


def _badam(model, cfg):
    """BAdam: AdamW on one decoder layer at a time, switching so each layer gets its turn within the round."""
    from badam import BlockOptimizer

    n = model.config.num_hidden_layers
    prefixes = [[f"model.layers.{i}."] for i in range(n)]
    base = torch.optim.AdamW(model.parameters(), lr=cfg.learning_rate, weight_decay=cfg.weight_decay)
    with warnings.catch_warnings():  # "BAdam expect model to be loaded in fp16/bf16": float32 works, with more memory
        warnings.filterwarnings("ignore", message="BAdam expect")
        return BlockOptimizer(base_optimizer=base, named_parameters_list=list(model.named_parameters()),
                              block_prefix_list=prefixes, switch_block_every=max(1, math.ceil(cfg.max_steps / n)),
                              switch_mode="ascending", verbose=0)


class Chained(torch.optim.Optimizer):
    """Several optimizers over disjoint parameters, stepped as one (a scheduler sets every group's lr)."""

    def __init__(self, optimizers: list) -> None:
        self.optimizers = optimizers
        self.defaults = optimizers[0].defaults
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = {}, {}
        self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks = {}, {}
        self._optimizer_load_state_dict_pre_hooks, self._optimizer_load_state_dict_post_hooks = {}, {}

    @property
    def param_groups(self):
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self):
        return {k: v for o in self.optimizers for k, v in o.state.items()}

    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for o in self.optimizers:
            o.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def state_dict(self):
        return {"optimizers": [o.state_dict() for o in self.optimizers]}

    def load_state_dict(self, state_dict) -> None:
        for o, s in zip(self.optimizers, state_dict["optimizers"]):
            o.load_state_dict(s)
