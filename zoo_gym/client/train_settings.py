"""A contributor's training settings: one ``gym-client join`` flag per ``TrainConfig`` field, and ``--config``.

The flags are generated from the dataclass fields and their ``help`` / ``group`` / ``aliases`` metadata,
so a new field is a new flag. Names are TRL's and PEFT's (``--learning-rate``, ``--num-train-epochs``,
``--use-dora``); LLaMA-Factory's are accepted where they differ (``lora_rank``, ``cutoff_len``,
``per_device_train_batch_size``, ``lora_target``, ``pissa_init``). Precedence: flag, then config file,
then the TrainConfig default. An unknown key is an error naming it and the closest valid key.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import inspect
import typing
from pathlib import Path
from typing import Any, Optional

import typer

from zoo_gym.gym_train.config import TrainConfig
from zoo_gym.settings_file import SettingsFileError, read_settings_file


class TrainSettingsError(ValueError):
    """A training setting is unknown, malformed or impossible; the message names it."""


# fields with a hand-written join option of their own (it picks the built-in task too)
_OWN_OPTION = ("method",)
_FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
# LLaMA-Factory spellings whose values differ from ours: key -> (field, value converter)
_VALUE_ALIASES = {"pissa_init": ("init_lora_weights", lambda v: "pissa" if v else True)}


def _aliases() -> dict[str, str]:
    out = {}
    for name, f in _FIELDS.items():
        for alias in f.metadata.get("aliases", ()):
            out[alias] = name
    return out


ALIASES = _aliases()


def _flag_type(name: str):
    """The CLI type of a field: its base type, or str for unions that a command line spells as text."""
    hint = typing.get_type_hints(TrainConfig)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    if len(args) == 1 and args[0] in (int, float, str, bool):
        return args[0]
    return str  # str | list[str] (comma-separated), bool | str (true, false, pissa ...)


def _panel(group: str) -> str:
    return "Training" if group == "Training" else f"Training: {group}"


def _option(name: str) -> inspect.Parameter:
    f = _FIELDS[name]
    kind = _flag_type(name)
    flag = "--" + name.replace("_", "-")
    decls = [flag] + ["--" + a.replace("_", "-") for a in f.metadata.get("aliases", ()) if len(a) > 1]
    if kind is bool:
        decls = [f"{flag}/--no-{flag[2:]}"]
    default = f.default
    shown = "all-linear" if name == "target_modules" else ("unset" if default is None else str(default).lower()
                                                            if isinstance(default, bool) else default)
    info = typer.Option(None, *decls, help=f"{f.metadata.get('help', '')} \\[default: {shown}]",
                        rich_help_panel=_panel(f.metadata.get("group", "Training")), show_default=False)
    return inspect.Parameter(f"train__{name}", inspect.Parameter.KEYWORD_ONLY, default=info,
                             annotation=Optional[kind])


def with_train_options(fn):
    """Add one option per TrainConfig field (and ``--config``) to a Typer command ``fn(..., train_flags)``.

    ``fn`` receives ``train_flags``: the fields given on the command line (``None`` for unset ones
    are dropped) and ``train_config_file``: the ``--config`` path or None."""
    sig = inspect.signature(fn)
    own = [p for p in sig.parameters.values() if p.name not in ("train_flags", "train_config_file")]
    config_param = inspect.Parameter(
        "train_config_file", inspect.Parameter.KEYWORD_ONLY, annotation=Optional[Path],
        default=typer.Option(None, "--config", help="Training settings from a YAML or TOML file (TrainConfig, "
                                                    "TRL/PEFT or LLaMA-Factory names); flags win over it.",
                             rich_help_panel=_panel("Training")))
    extra = [_option(name) for name in _FIELDS if name not in _OWN_OPTION]

    @functools.wraps(fn)
    def wrapper(**kwargs):
        flags = {p.name[len("train__"):]: kwargs.pop(p.name) for p in extra}
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
        if isinstance(value, dict):
            flat.update(value)
        else:
            flat[key] = value
    return flat


def _canonical(key: str, *, origin: str) -> str:
    k = str(key).strip().lower().replace("-", "_")
    if k in _FIELDS or k in _VALUE_ALIASES:
        return k
    if k in ALIASES:
        return ALIASES[k]
    valid = sorted({*_FIELDS, *ALIASES, *_VALUE_ALIASES})
    close = difflib.get_close_matches(k, valid, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise TrainSettingsError(f"{origin}: unknown training setting {key!r}{hint}")


def _parse_bool_or_str(value: Any) -> bool | str:
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    return value


def _parse_modules(value: Any) -> str | list[str]:
    if isinstance(value, str):
        if value.strip().lower() in ("all", "all-linear", "all_linear"):
            return "all-linear"
        names = [v.strip() for v in value.split(",") if v.strip()]
        return names[0] if len(names) == 1 else names
    return list(value) if isinstance(value, list | tuple) else value


def normalise_settings(values: dict[str, Any], *, origin: str) -> dict[str, Any]:
    """Keys to TrainConfig field names, values to their types (unknown keys are errors)."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        name = _canonical(key, origin=origin)
        if name in _VALUE_ALIASES:
            name, convert = _VALUE_ALIASES[name]
            value = convert(value)
        if name == "target_modules":
            value = _parse_modules(value)
        elif name == "init_lora_weights":
            value = _parse_bool_or_str(value)
        elif value is not None and _flag_type(name) is float and isinstance(value, int | str) \
                and not isinstance(value, bool):
            try:
                value = float(value)  # YAML reads 3e-4 as a string
            except ValueError:
                raise TrainSettingsError(f"{origin}: {key!r} must be a number, got {value!r}") from None
        if name in out:
            raise TrainSettingsError(f"{origin}: {name!r} is given twice (as {key!r} too)")
        out[name] = value
    return out


def resolve(train_flags: dict[str, Any], config_file: Path | None, *, method: str | None,
            max_steps: int | None = None) -> tuple[str, dict[str, Any]]:
    """(method, TrainConfig keyword overrides) from the flags, the config file and the defaults.

    ``max_steps``: the join option of the same name, for callers of the library API."""
    file_values = normalise_settings(read_train_file(config_file), origin=f"--config {config_file}") \
        if config_file else {}
    flags = normalise_settings(train_flags, origin="flags")
    if max_steps is not None:
        flags.setdefault("max_steps", max_steps)
    if "num_train_epochs" in flags and "max_steps" in file_values:
        file_values.pop("max_steps")  # a flag wins over the file, whichever way the round is measured
    if "max_steps" in flags and "num_train_epochs" in file_values:
        file_values.pop("num_train_epochs")
    merged = {**file_values, **flags}
    if "max_steps" in merged and merged.get("num_train_epochs") is not None:
        raise TrainSettingsError("set either max_steps or num_train_epochs (epochs), not both")
    chosen = method or merged.pop("method", None) or "lora"
    merged.pop("method", None)
    return chosen, merged


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
    if config.warmup_steps and config.warmup_steps >= steps:
        raise TrainSettingsError(
            f"warmup_steps ({config.warmup_steps}) must be smaller than the round's {steps} optimizer step(s): "
            "the learning rate would never reach its peak, and the first step's is 0 (a 1-step round uploads "
            "an all-zero delta the server refuses); lower --warmup-steps or raise --max-steps")
    device = config.device
    if device != "auto" and not _device_available(device):
        raise TrainSettingsError(f"device {device!r} is not available on this machine; use --device auto or cpu")
    if config.fp16:
        import torch

        if device in ("cpu", "mps") or not torch.cuda.is_available():
            raise TrainSettingsError("fp16 mixed precision needs a CUDA GPU; use --bf16 or neither on this machine")
    return config
