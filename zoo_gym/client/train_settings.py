"""A contributor's training settings: one ``gym-client join`` flag per ``TrainConfig`` field, and ``--config``.

Declared once in ``TrainConfig`` (help, group, aliases metadata) and derived by ``zoo_gym.settings``: flag
``--learning-rate``, file key ``learning_rate``/``learning-rate``, environment ``ZOO_GYM_LEARNING_RATE``.
Names are TRL's and PEFT's; LLaMA-Factory's are accepted where they differ (``lora_rank``, ``cutoff_len``,
``per_device_train_batch_size``, ``lora_target``, ``pissa_init``). Precedence: flag > environment > file >
default; ``max_steps``/``num_train_epochs`` and ``warmup_steps``/``warmup_ratio`` exclude each other, the higher
source's one wins. File keys the server or client decides (``ecosystem_keys``) are set aside with a warning;
TRL config keys about where and how a run executes rather than what it learns (vLLM, the Hub, trackers, logging,
saving, evaluation, distributed training: ``_LOCAL_RUN_*``) are set aside together with one warning naming them.
A learning rate far above the stage's usual range adds a warning (``gym_train.config.learning_rate_warning``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

import typer

from zoo_gym.client.ecosystem_keys import set_aside
from zoo_gym.gym_train.config import METHODS, TrainConfig, learning_rate_warning
from zoo_gym.settings import Leaf, SettingError, collect, leaves, typer_parameters
from zoo_gym.settings_file import SettingsFileError, read_settings_file


class TrainSettingsError(ValueError):
    """A training setting is unknown, malformed or impossible; the message names it."""


# fields with a hand-written join option of their own (it picks the built-in task too)
_OWN_OPTION = ("method",)
# settings that give one measure two ways: a higher source's one wins, both in one source are refused
_EXCLUSIVE = (("max_steps", "num_train_epochs"), ("warmup_steps", "warmup_ratio"))
_PARAM_PREFIX = "train__"
# TRL config fields (GRPOConfig, RLOOConfig, SFTConfig, DPOConfig, KTOConfig and their TrainingArguments) that say
# where and how a run executes, not what it learns: a contributor's round generates with transformers in one local
# process, logs through report_to, saves nothing and uploads its delta to the server. Only keys TRL itself has
# are set aside (a misspelling is still refused), and never one that is a TrainConfig setting.
_LOCAL_RUN_KEYS = ("use_vllm", "ds3_gather_for_generation", "parallelism_config", "average_tokens_across_devices",
                   "dataset_num_proc", "disable_tqdm", "project", "skip_memory_metrics", "log_completions",
                   "num_completions_to_print", "log_unique_prompts", "log_multimodal", "log_level",
                   "log_level_replica", "log_on_each_node", "load_best_model_at_end", "metric_for_best_model",
                   "greater_is_better", "do_predict", "prediction_loss_only", "batch_eval_metrics",
                   "bf16_full_eval", "fp16_full_eval", "include_for_metrics", "num_generations_eval",
                   "restore_callback_states_from_checkpoint", "ignore_data_skip", "torch_empty_cache_steps")
_LOCAL_RUN_PREFIXES = ("vllm_", "hub_", "push_to_hub", "logging_", "save_", "eval_", "dataloader_", "trackio_",
                       "log_completions_", "torch_compile", "tpu_")


def _panel(group: str) -> str:
    return "Training" if group == "Training" else f"Training: {group}"


def train_leaves() -> list[Leaf]:
    """TrainConfig's settings, each shown under its group's panel."""
    group = {f.name: f.metadata.get("group", "Training") for f in dataclasses.fields(TrainConfig)}
    return [dataclasses.replace(leaf, section=_panel(group[leaf.key])) for leaf in leaves(TrainConfig)]


def with_train_options(fn):
    """Add one option per TrainConfig field (and ``--config``) to a Typer command ``fn(..., train_flags)``.

    ``fn`` receives ``train_flags``: the fields given on the command line (``None`` for unset ones
    are dropped) and ``train_config_file``: the ``--config`` path or None."""
    sig = inspect.signature(fn)
    own = [p for p in sig.parameters.values() if p.name not in ("train_flags", "train_config_file")]
    config_param = inspect.Parameter(
        "train_config_file", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path],
        default=typer.Option(None, "--config", help="Training settings from a YAML or TOML file (TrainConfig, "
                                                    "TRL/PEFT or LLaMA-Factory names); flags and ZOO_GYM_<KEY> "
                                                    "environment variables win over it.",
                             rich_help_panel=_panel("Training")))
    extra = typer_parameters([leaf for leaf in train_leaves() if leaf.key not in _OWN_OPTION],
                             name_prefix=_PARAM_PREFIX, alias_flags=True)

    @functools.wraps(fn)
    def wrapper(**kwargs):
        flags = {p.name[len(_PARAM_PREFIX):]: kwargs.pop(p.name) for p in extra}
        config_file = kwargs.pop("train_config_file")
        return fn(**kwargs, train_flags={k: v for k, v in flags.items() if v is not None},
                  train_config_file=config_file)

    wrapper.__signature__ = sig.replace(parameters=[*own, config_param, *extra])
    wrapper.__annotations__ = {**{k: v for k, v in fn.__annotations__.items()
                                  if k not in ("train_flags", "train_config_file")},
                               "train_config_file": Optional[Path], **{p.name: p.annotation for p in extra}}
    return wrapper


def read_train_file(path: Path) -> dict[str, Any]:
    """A YAML (.yaml/.yml) or TOML (.toml) file as a flat dict; sections are only for readability."""
    try:
        raw = read_settings_file(path)
    except SettingsFileError as exc:
        raise TrainSettingsError(f"--config {exc}") from None
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        flat.update(value if isinstance(value, dict) else {key: value})
    return {str(k).strip().lower(): v for k, v in flat.items()}


def _layer(origin: str, index: int, **source: Any) -> dict[str, Any]:
    """Source `index` (0 file, 1 environment, 2 flags) as checked values by field name; errors name it."""
    try:
        if index == 0:
            _refuse_twice(source["file_values"])
        return collect(train_leaves(), file_text=True, **source)[index]
    except SettingError as exc:
        raise TrainSettingsError(f"{origin}: {exc}") from None


def _refuse_twice(values: dict[str, Any]) -> None:
    field_of = {a: leaf.key for leaf in train_leaves() for a in (leaf.key, *leaf.aliases)}
    seen: dict[str, str] = {}
    for key in values:
        name = field_of.get(key.replace("-", "_"), key)
        if name in seen:
            raise SettingError(f"{name!r} is given twice (as {seen[name]!r} and {key!r})")
        seen[name] = key


def resolve(train_flags: dict[str, Any], config_file: Path | None, *, method: str | None = None,
            max_steps: int | None = None, environ: Mapping[str, str] | None = None
            ) -> tuple[dict[str, Any], list[str]]:
    """(TrainConfig keyword overrides, warnings) from the flags, ``ZOO_GYM_<KEY>`` in ``environ``, the config
    file and the defaults (TrainConfig's own checks run when the round's config is built).

    ``method``: the deprecated ``--method`` (it becomes stage and finetuning_type, with one warning);
    ``max_steps``: the join option of the same name, for callers of the library API."""
    warnings: list[str] = []
    file_values = {}
    if config_file:
        names = {a for leaf in train_leaves() for a in (leaf.key, *leaf.aliases)}
        raw, warnings = set_aside(read_train_file(config_file), names)
        raw, local = set_aside_local_run_keys(raw, names)
        warnings += local
        file_values = _layer(f"--config {config_file}", 0, file_values=raw)
    env_values = _layer("environment", 1, environ=environ)
    flags = _layer("flags", 2, flags=train_flags)
    if max_steps is not None:
        flags.setdefault("max_steps", max_steps)
    layers = [flags, env_values, file_values]  # highest first
    for pair in _EXCLUSIVE:
        for i, higher in enumerate(layers):
            for key in pair:
                if higher.get(key) is not None:
                    for lower in layers[i + 1:]:
                        lower.pop(pair[1 - pair.index(key)], None)
    merged = {**file_values, **env_values, **flags}
    for first, second in _EXCLUSIVE:
        if merged.get(first) is not None and merged.get(second) is not None:
            raise TrainSettingsError(f"set either {first} or {second}"
                                     f"{' (epochs)' if second == 'num_train_epochs' else ''}, not both")
    chosen = method or merged.pop("method", None)
    merged.pop("method", None)
    if chosen is not None:
        _apply_method(chosen, merged, warnings, given="--method" if method else "method")
    warnings += _learning_rate_warnings(merged)
    return merged, warnings


def _trl_config_fields() -> set[str]:
    """Every field name of TRL's trainer configs the client's stages use (imported only when a file has keys
    that are no setting, so a plain config costs no TRL import)."""
    import trl

    classes = (trl.GRPOConfig, trl.RLOOConfig, trl.SFTConfig, trl.DPOConfig, trl.KTOConfig)
    return {f.name for cls in classes for f in dataclasses.fields(cls)}


def set_aside_local_run_keys(values: dict[str, Any], settings: set[str]) -> tuple[dict[str, Any], list[str]]:
    """(``values`` less TRL's keys about where and how a run executes, [one warning naming them all] or []).
    A key that is a setting, or that TRL does not have, stays for the caller (a misspelling is refused there)."""
    def local(key: str) -> bool:
        name = key.strip().replace("-", "_")
        return name not in settings and (name in _LOCAL_RUN_KEYS or name.startswith(_LOCAL_RUN_PREFIXES))

    candidates = [k for k in values if local(k)]
    if not candidates:
        return dict(values), []
    trl_fields = _trl_config_fields()
    dropped = [k for k in candidates if k.strip().replace("-", "_") in trl_fields]
    kept = {k: v for k, v in values.items() if k not in dropped}
    given = [k for k in dropped if values[k] is not None]  # a null asks nothing: dropped without a word
    if not given:
        return kept, []
    return kept, [f"set aside TRL settings that do not apply to a contributor's local round: "
                  f"{', '.join(f'`{k}`' for k in given)} (generation runs in transformers in this one process, "
                  "metrics go to report_to, nothing is saved or pushed: the delta is uploaded to the server)"]


def _learning_rate_warnings(merged: dict[str, Any]) -> list[str]:
    """[one line] when the round's learning rate (given or default) is far above its stage's usual range."""
    defaults = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
    values = {k: merged.get(k, defaults[k]) for k in ("stage", "finetuning_type", "learning_rate")}
    try:
        line = learning_rate_warning(values["stage"], values["finetuning_type"], values["learning_rate"])
    except (TypeError, ValueError):
        return []  # a malformed value is TrainConfig's to refuse, in its own words
    return [line] if line else []


def _apply_method(method: str, merged: dict[str, Any], warnings: list[str], *, given: str) -> None:
    """The deprecated `method` as the stage and fine-tuning type it names; refused where they disagree."""
    if method not in METHODS:
        raise TrainSettingsError(f"{given} must be one of {', '.join(METHODS)}, got {method!r} "
                                 "(deprecated: use --stage and --finetuning-type)")
    stage, kind = METHODS[method]
    for key, value in (("stage", stage), ("finetuning_type", kind)):
        if merged.get(key, value) != value:
            raise TrainSettingsError(f"{given} {method} means {key} {value!r}, but {key} is {merged[key]!r}: "
                                     f"drop {given} and use --stage and --finetuning-type")
    merged.update(stage=stage, finetuning_type=kind)
    warnings.append(f"{given} {method} is deprecated: use --stage {stage} --finetuning-type {kind}")


def _device_available(device: str) -> bool:
    import torch

    if device == "cuda":
        return torch.cuda.is_available()
    if device == "mps":
        return bool(getattr(torch.backends, "mps", None)) and torch.backends.mps.is_available()
    return True


def check_round(config: TrainConfig, *, n_train: int) -> TrainConfig:
    """The config of a round over ``n_train`` examples (epochs turned into steps), or TrainSettingsError
    in one line when it cannot train: checked before any registration, download or training."""
    steps = config.steps_for(n_train)
    if config.num_train_epochs is not None:
        config = dataclasses.replace(config, max_steps=steps, num_train_epochs=None)
    config = dataclasses.replace(config, warmup_steps=config.warmup_for(steps))  # a warmup_ratio as steps
    if config.warmup_steps and config.warmup_steps >= steps:
        given = f"warmup_ratio {config.warmup_ratio} gives {config.warmup_steps} warm-up steps, which" \
            if config.warmup_ratio is not None else f"warmup_steps ({config.warmup_steps})"
        raise TrainSettingsError(
            f"{given} must be smaller than the round's {steps} optimizer step(s): "
            "the learning rate would never reach its peak, and the first step's is 0 (a 1-step round uploads "
            "an all-zero delta the server refuses); lower the warm-up or raise --max-steps")
    device = config.device
    if device != "auto" and not _device_available(device):
        raise TrainSettingsError(f"device {device!r} is not available on this machine; use --device auto or cpu")
    if config.fp16:
        import torch

        if device in ("cpu", "mps") or not torch.cuda.is_available():
            raise TrainSettingsError("fp16 mixed precision needs a CUDA GPU; use --bf16 or neither on this machine")
    return config
