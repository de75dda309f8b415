"""The Join form's fields: `gym-client join`'s own click options, so the page and the CLI share one declaration.

A training option (``train__KEY``) takes its default, help and panel from TrainConfig (``train_leaves``); join's
own options from their typer declaration. `argv` turns the page's values back into `gym-client join` flags,
refusing a name that is no field, so the page can start nothing the CLI would not accept.
"""

from __future__ import annotations

from typing import Any

import click

from zoo_gym.client.train_settings import train_leaves
from zoo_gym.gym_train.config import FINETUNING_TYPES, RL_STAGES, STAGES

_PREFIX = "train__"
# join's options that belong to the page, not to the form: the page reads --json, and shows its own progress
_PAGE_OWNS = ("as_json", "quiet", "dry_run", "help")
_CHOICES = {"train__stage": list(STAGES), "train__finetuning_type": list(FINETUNING_TYPES)}
# a panel shown only when the round's stage or fine-tuning type uses it (every panel is reachable)
_WHEN = {"Training: RL": {"stage": list(RL_STAGES)}, "Training: LoRA": {"finetuning_type": ["lora"]},
         "Training: Freeze": {"finetuning_type": ["freeze"]}, "Training: OFT": {"finetuning_type": ["oft"]}}


class FieldError(ValueError):
    """A value the page sent is no field of join, or not of its type; the message names it."""


def _kind(param: click.Option) -> str:
    if param.is_flag:
        return "bool"
    name = getattr(param.type, "name", "text")
    return {"integer": "int", "float": "float", "integer range": "int", "float range": "float"}.get(name, "text")


def join_fields(join_command: click.Command) -> list[dict[str, Any]]:
    """Every option of `join` but those the page owns, as {name, flag, kind, default, help, panel, ...}."""
    leaves = {_PREFIX + leaf.key: leaf for leaf in train_leaves()}
    out = []
    for p in join_command.params:
        if not isinstance(p, click.Option) or p.name in _PAGE_OWNS:
            continue
        leaf = leaves.get(p.name)
        default = leaf.default if leaf is not None else p.default
        help_text = leaf.help if leaf is not None else (p.help or "")
        panel = getattr(p, "rich_help_panel", None) or "Join"
        out.append({"name": p.name, "flag": p.opts[0], "off_flag": (p.secondary_opts or [None])[0],
                    "kind": "list" if p.multiple else _kind(p), "default": default if default != () else [],
                    "help": help_text.replace("\\[", "["), "panel": panel, "required": bool(p.required),
                    "choices": _CHOICES.get(p.name), "when": _WHEN.get(panel)})
    return out


def _text(field: dict, value: Any) -> str:
    if field["kind"] in ("int", "float"):
        try:
            return str(int(value) if field["kind"] == "int" else float(value))
        except (TypeError, ValueError):
            raise FieldError(f"{field['flag']} must be {'an integer' if field['kind'] == 'int' else 'a number'}, "
                             f"got {value!r}") from None
    return str(value)


def argv(join_command: click.Command, values: dict[str, Any]) -> list[str]:
    """`gym-client join` flags for the page's `values` ({field name: value}); empty values, and switches left at
    their default, are left out, so the CLI's own defaults, environment and --config apply as in a shell."""
    fields = {f["name"]: f for f in join_fields(join_command)}
    out: list[str] = []
    for name, value in values.items():
        field = fields.get(name)
        if field is None:
            raise FieldError(f"{name!r} is no setting of gym-client join")
        if value is None or value == "" or value == [] or (field["kind"] == "bool" and value == field["default"]):
            continue
        if field["kind"] == "bool":
            if not isinstance(value, bool):
                raise FieldError(f"{field['flag']} must be true or false, got {value!r}")
            flag = field["flag"] if value else field["off_flag"]
            out += [flag] if flag else []
        elif field["kind"] == "list":
            for item in value if isinstance(value, list) else str(value).split(","):
                out += [field["flag"], str(item).strip()]
        else:
            out += [field["flag"], _text(field, value)]
    return out
