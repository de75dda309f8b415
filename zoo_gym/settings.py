"""Settings declared once: a dataclass field is a program's setting, with its flag, file key and environment variable.

A leaf field's name is its key: file key ``trim_beta`` or ``trim-beta``, flag ``--trim-beta``, environment
variable ``ZOO_GYM_TRIM_BETA``; its default and ``metadata["help"]`` are the only ones. A dataclass-typed
field is a section (leaves flattened with ``metadata["prefix"]``, shown under ``metadata["section"]``).
Precedence: flag > environment > file > default. Optional metadata: ``aliases``, ``value_aliases``,
``alias_values``. A leaf is int, float, str or bool (or optional), a union of str with bool and/or
list[str], or list[str] (a repeatable flag). Why not pydantic-settings: docs/design/settings.md.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional

import typer

ENV_PREFIX = "ZOO_GYM_"
_TYPE_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


class SettingError(ValueError):
    """A setting is unknown, of the wrong type or out of range; the message names it."""


@dataclass(frozen=True)
class Leaf:
    key: str                 # flat name: file key, flag and environment variable derive from it
    path: tuple[str, ...]    # attribute path from the root settings object
    kind: type               # int, float, str or bool
    optional: bool           # None is a valid value ("unset")
    default: Any
    help: str
    section: str
    aliases: tuple[str, ...] = ()  # other file keys accepted for it (names a release wrote before)
    accepts: tuple[type, ...] = ()  # a union leaf's types (str with bool and/or list); kind is then str
    value_aliases: Mapping[Any, Any] = field(default_factory=dict, compare=False)  # text -> value
    alias_values: Mapping[str, Mapping[Any, Any]] = field(default_factory=dict, compare=False)  # alias -> values

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.key.upper()

    @property
    def repeatable(self) -> bool:
        """A list[str] leaf: its flag (and its aliases' flags) repeat, its environment text is comma-separated."""
        return self.accepts == (list,)


def _plain(hint: Any) -> tuple[type, bool, tuple[type, ...]]:
    """(int|float|str|bool, optional, a union's types or ()) of a leaf's annotation."""
    args = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
    wanted = [a for a in args if a is not type(None)]
    if len(wanted) == 1 and wanted[0] in _TYPE_NAMES:
        return wanted[0], type(None) in args, ()
    if wanted == [list[str]]:
        return str, type(None) in args, (list,)
    accepts = tuple(list if a == list[str] else a for a in wanted)
    if len(accepts) > 1 and str in accepts and set(accepts) <= {str, bool, list}:
        return str, type(None) in args, accepts
    raise TypeError(f"a setting must be int, float, str or bool (or optional), or str | bool | list[str], "
                    f"got {hint!r}")


def _type_name(leaf: Leaf) -> str:
    if not leaf.accepts:
        return _TYPE_NAMES[leaf.kind]
    if leaf.repeatable:
        return "a list of strings"
    return " or ".join(["true or false"] * (bool in leaf.accepts) + ["a string"] +
                       ["a comma-separated list of strings"] * (list in leaf.accepts))


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else None


def leaves(cls: type, *, prefix: str = "", path: tuple[str, ...] = (), section: str = "Server settings",
           exclude: tuple[str, ...] = ()) -> list[Leaf]:
    """Every leaf setting of the dataclass `cls`, sections flattened, in declaration order. A section field's
    metadata may name `exclude`d fields of its class: they are not settings there and keep their defaults."""
    hints = typing.get_type_hints(cls)
    out: list[Leaf] = []
    for f in dataclasses.fields(cls):
        if not f.init or f.name in exclude:
            continue
        hint = hints[f.name]
        if dataclasses.is_dataclass(hint):
            out += leaves(hint, prefix=prefix + f.metadata.get("prefix", ""), path=(*path, f.name),
                          section=f.metadata.get("section", section), exclude=tuple(f.metadata.get("exclude", ())))
            continue
        kind, optional, accepts = _plain(hint)
        alias_values = {prefix + a: v for a, v in f.metadata.get("alias_values", {}).items()}
        out.append(Leaf(key=prefix + f.name, path=(*path, f.name), kind=kind, optional=optional, default=_default(f),
                        help=f.metadata.get("help", ""), section=f.metadata.get("section", section),
                        aliases=tuple(prefix + a for a in (*f.metadata.get("aliases", ()), *alias_values)),
                        accepts=accepts, value_aliases=dict(f.metadata.get("value_aliases", {})),
                        alias_values=alias_values))
    keys = [leaf.key for leaf in out]
    if len(set(keys)) != len(keys):
        raise TypeError(f"{cls.__name__}: two settings share a key: {sorted(k for k in keys if keys.count(k) > 1)}")
    return out


def norm_key(key: str) -> str:
    return str(key).strip().replace("-", "_")


def check_type(key: str, value: Any, leaf: Leaf) -> Any:
    """`value` if it is of the leaf's type (an int where a float is wanted is widened), else SettingError."""
    if value is None and leaf.optional:
        return None
    if leaf.accepts:
        return _check_union(key, value, leaf)
    want = leaf.kind
    ok = (isinstance(value, bool) if want is bool else
          isinstance(value, (int, float)) and not isinstance(value, bool) if want is float else
          isinstance(value, want) and not isinstance(value, bool))
    if not ok:
        raise SettingError(f"`{key}` must be {_TYPE_NAMES[want]}{' or empty' if leaf.optional else ''}, got "
                           f"{value!r} ({type(value).__name__})")
    if want is str:
        return leaf.value_aliases.get(value, value)
    return float(value) if want is float else value


def _check_union(key: str, value: Any, leaf: Leaf) -> Any:
    if isinstance(value, str):
        return parse_text(leaf, value, source=key)
    if isinstance(value, bool) and bool in leaf.accepts:
        return value
    if (isinstance(value, (list, tuple)) and list in leaf.accepts and (value or leaf.repeatable)
            and all(isinstance(v, str) for v in value)):
        return list(value)
    raise SettingError(f"`{key}` must be {_type_name(leaf)}{' or empty' if leaf.optional else ''}, got "
                       f"{value!r} ({type(value).__name__})")


def _parse_union(leaf: Leaf, text: str) -> Any:
    if bool in leaf.accepts and text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text in leaf.value_aliases:
        return leaf.value_aliases[text]
    if list in leaf.accepts:
        names = [v.strip() for v in text.split(",") if v.strip()]
        return names if leaf.repeatable or len(names) != 1 else names[0]
    return text


def parse_text(leaf: Leaf, text: str, *, source: str) -> Any:
    """An environment variable's text as the leaf's type; SettingError naming `source`."""
    text = text.strip()
    if leaf.optional and text.lower() in ("", "none", "null"):
        return None
    if leaf.accepts:
        return _parse_union(leaf, text)
    if leaf.kind is str:
        return leaf.value_aliases.get(text, text)
    try:
        if leaf.kind is bool:
            if text.lower() in ("1", "true", "yes", "on"):
                return True
            if text.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        return leaf.kind(text)
    except ValueError:
        raise SettingError(f"{source}={text!r}: must be {_type_name(leaf)}"
                           f"{' or empty' if leaf.optional else ''}") from None


def _same_words(key: str, candidate: str) -> bool:
    """True when `candidate` is `key` spelled right: the same words but for one misspelt (or merged/split) one,
    at most 2 letters (a third of the word) off. A word more or less (`max_grad_norm`, `dp_max_grad_norm`) or another word (`save_steps`, `max_steps`) is a
    different setting, never a typo."""
    if key.replace("_", "") == candidate.replace("_", ""):
        return True
    a, b = key.split("_"), candidate.split("_")
    if len(a) != len(b):
        return False
    differ = [(x, y) for x, y in zip(a, b) if x != y]
    return len(differ) == 1 and _edits(*differ[0]) <= min(2, len(differ[0][1]) // 3)


def _edits(a: str, b: str) -> int:
    """Letters inserted, deleted, replaced or swapped with their neighbour to turn `a` into `b`."""
    d = [[i + j if not i * j else 0 for j in range(len(b) + 1)] for i in range(len(a) + 1)]
    for i in range(1, len(a) + 1):
        for j in range(1, len(b) + 1):
            d[i][j] = min(d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + (a[i - 1] != b[j - 1]))
            if i > 1 and j > 1 and a[i - 1] == b[j - 2] and a[i - 2] == b[j - 1]:
                d[i][j] = min(d[i][j], d[i - 2][j - 2] + 1)
    return d[-1][-1]


def unknown_key(key: str, valid: list[str], also: Sequence[str] = ()) -> SettingError:
    """The error for an unknown `key`: the closest of `valid` and `also` (other accepted spellings) that is
    the same words as `key` but for a typo (`_same_words`), and `valid`."""
    close = [c for c in difflib.get_close_matches(key, sorted({*valid, *also}), n=5, cutoff=0.75)
             if _same_words(key, c)]
    hint = f"; did you mean `{close[0]}`?" if close else ""
    return SettingError(f"unknown setting `{key}`{hint} (valid settings: {', '.join(sorted(valid))}; dashes or "
                        "underscores alike)")


def _leaves_of(spec: Any) -> list[Leaf]:
    return leaves(spec) if isinstance(spec, type) else list(spec)


def collect(spec: Any, *, file_values: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None,
            flags: Mapping[str, Any] | None = None, file_text: bool = False) -> tuple[dict, dict, dict]:
    """The checked values ({key: value}) that the file, the environment `ZOO_GYM_<KEY>` and the flags (None: not
    given) set, in that order of precedence, lowest first. `spec`: a settings dataclass or its leaves.

    Unknown file or flag keys are refused with the closest valid key; values are type-checked by key. With
    `file_text`, a string in the file for a number or a flag is read as the environment's text would be."""
    by_key = {leaf.key: leaf for leaf in _leaves_of(spec)}
    alias = {a: leaf.key for leaf in by_key.values() for a in leaf.aliases}
    layers: tuple[dict, dict, dict] = ({}, {}, {})
    for key, value in (file_values or {}).items():
        n = norm_key(key)
        k = alias.get(n, n)
        if k not in by_key:
            raise unknown_key(k, list(by_key), also=list(alias))
        leaf = by_key[k]
        if n in leaf.alias_values:
            spelled = leaf.alias_values[n]
            if not any(value == v and type(value) is type(v) for v in spelled):
                raise SettingError(f"`{n}` must be one of {', '.join(map(repr, spelled))}, got {value!r}")
            value = spelled[value]
        if file_text and isinstance(value, str) and leaf.kind is not str:
            layers[0][k] = parse_text(leaf, value, source=key)
        else:
            layers[0][k] = check_type(k, value, leaf)
    for leaf in by_key.values():
        text = (environ or {}).get(leaf.env)
        if text is not None:
            layers[1][leaf.key] = parse_text(leaf, text, source=leaf.env)
    for key, value in (flags or {}).items():
        k = norm_key(key)
        if k not in by_key:
            raise unknown_key(k, list(by_key), also=list(alias))
        if value is not None:
            layers[2][k] = check_type(k, value, by_key[k])
    return layers


def resolve(cls: type, *, file_values: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None,
            flags: Mapping[str, Any] | None = None) -> Any:
    """An instance of `cls` from flags (None: not given) > environment `ZOO_GYM_<KEY>` > file > defaults.

    Unknown file or flag keys are refused with the closest valid key; values are type-checked by key; the
    dataclasses' own checks (``__post_init__``) then run, their ValueErrors re-raised as SettingError."""
    by_key = {leaf.key: leaf for leaf in leaves(cls)}
    chosen: dict[str, Any] = {}
    for layer in collect(cls, file_values=file_values, environ=environ, flags=flags):
        chosen.update(layer)
    return build(cls, {by_key[k].path: v for k, v in chosen.items()})


def build(cls: type, values: Mapping[tuple[str, ...], Any], path: tuple[str, ...] = ()) -> Any:
    """`cls` with the given leaf values (by attribute path), sections built bottom-up, the rest defaults."""
    hints = typing.get_type_hints(cls)
    kwargs: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        here = (*path, f.name)
        if dataclasses.is_dataclass(hints[f.name]):
            kwargs[f.name] = build(hints[f.name], values, here)
        elif here in values:
            kwargs[f.name] = values[here]
    try:
        return cls(**kwargs)
    except SettingError:
        raise
    except (ValueError, TypeError) as exc:
        raise SettingError(str(exc)) from exc


def flat_values(settings: Any) -> dict[str, Any]:
    """{key: value} of every leaf of a settings object (what --help's defaults and status show)."""
    out = {}
    for leaf in leaves(type(settings)):
        value = settings
        for name in leaf.path:
            value = getattr(value, name)
        out[leaf.key] = value
    return out


def _default_text(leaf: Leaf) -> str:
    if leaf.default is None:
        return "unset"
    if leaf.repeatable:
        return ", ".join(leaf.default) or "none"
    if leaf.kind is bool:
        return leaf.flag.removeprefix("--") if leaf.default else "no-" + leaf.flag.removeprefix("--")
    return str(leaf.default)


def typer_parameters(spec: Any, *, name_prefix: str = "", alias_flags: bool = False) -> list[inspect.Parameter]:
    """One keyword parameter per leaf (named `name_prefix` + key), default None (= not given), for a Typer
    command's signature; with `alias_flags`, a leaf's aliases of two letters or more are flags too."""
    params = []
    for leaf in _leaves_of(spec):
        help_text = re.sub(r"(?<!\\)\[", r"\\[", leaf.help)  # rich would take a bare [...] for markup
        text = f"{help_text} \\[default: {_default_text(leaf)}; env {leaf.env}]".strip()
        names = [leaf.flag] + ["--" + a.replace("_", "-") for a in leaf.aliases
                               if alias_flags and len(a) > 1 and a not in leaf.alias_values]
        names = [f"{leaf.flag}/--no-{leaf.flag[2:]}"] if leaf.kind is bool else names
        if leaf.repeatable:  # every alias is a flag too: `--mirror A --mirror B` for the key `mirrors`
            names += ["--" + a.replace("_", "-") for a in leaf.aliases if "--" + a.replace("_", "-") not in names]
        option = typer.Option(None, *names, help=text, rich_help_panel=leaf.section, show_default=False)
        params.append(inspect.Parameter(name_prefix + leaf.key, inspect.Parameter.KEYWORD_ONLY, default=option,
                                        annotation=Optional[list[str] if leaf.repeatable else leaf.kind]))
    return params


def with_settings(spec: Any) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator for a Typer command `f(*, settings_flags: dict, **own)`: adds one option per leaf of `spec` (a
    settings dataclass, or some of its leaves) to `f`'s own parameters and hands the given ones (None: not
    given) to `f` as `settings_flags`."""

    def wrap(f: Callable[..., Any]) -> Callable[..., Any]:
        hints = typing.get_type_hints(f)  # resolved: Typer cannot read string annotations from a signature
        own = [p.replace(annotation=hints.get(p.name, p.annotation))
               for p in inspect.signature(f).parameters.values() if p.name != "settings_flags"]
        keys = [leaf.key for leaf in _leaves_of(spec)]

        def command(**kwargs: Any) -> Any:
            flags = {k: kwargs.pop(k) for k in keys}
            return f(settings_flags=flags, **kwargs)

        command.__signature__ = inspect.Signature([*own, *typer_parameters(spec)])  # type: ignore[attr-defined]
        command.__name__, command.__doc__ = f.__name__, f.__doc__
        return command

    return wrap
