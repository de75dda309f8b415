"""A contributor's own reward functions (``TrainConfig.reward_funcs``), loaded and checked before training.

A spec is ``path/to/file.py:name`` (the file is imported by path) or ``module:name`` (imported by name).
A reward takes TRL's calling convention ``f(completions, **kwargs) -> list[float]`` (kwargs: ``prompts``,
``completion_ids``, ``trainer_state``, ... and every dataset column under its own name: ``answer`` for records
with an answer, a prompt-only record's ``solution``, ``ground_truth``, ...), one value (or None) per
completion. ``load_reward_funcs`` returns the callables, or None for the built-in rewards;
``check_reward_funcs`` also calls each once on a two-completion sample. Every failure is one line.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import numbers
import pathlib
import sys

from zoo_gym.evaluation.chat import prompt_messages

from .config import RL_STAGES, TrainConfig, reward_func_specs


class RewardFuncError(ValueError):
    """A reward function spec that cannot be used; the message (one line) names the spec."""


# the keyword arguments TRL passes a reward function itself; the dataset's columns come beside them
PASSED = ("completions", "prompts", "completion_ids", "trainer_state", "log_extra", "log_metric")
ANSWER = "answer"  # the column of a record's answer (its `output`), read by the built-in exact-answer reward
_SAMPLE = [{"instruction": "Solve.", "input": "Ann has 2 pens and gets 2 more. How many pens now?", "output": "4"},
           {"instruction": "Solve.", "input": "Bo has 5 cups and gives away 1. How many cups now?", "output": "4"}]


def _module_of(spec: str, target: str):
    if target.endswith(".py") or "/" in target or "\\" in target:
        path = pathlib.Path(target).expanduser()
        if not path.is_file():
            raise RewardFuncError(f"reward_funcs {spec!r}: file not found: {path}")
        name = f"zoo_gym_reward_{abs(hash(str(path.resolve())))}"
        loader_spec = importlib.util.spec_from_file_location(name, path)
        if loader_spec is None or loader_spec.loader is None:
            raise RewardFuncError(f"reward_funcs {spec!r}: {path} cannot be imported as Python")
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[name] = module  # pickling/dataclasses inside the file look it up
        try:
            loader_spec.loader.exec_module(module)
        except Exception as exc:
            sys.modules.pop(name, None)
            raise RewardFuncError(f"reward_funcs {spec!r}: importing {path} failed: "
                                  f"{type(exc).__name__}: {exc}") from None
        return module
    try:
        return importlib.import_module(target)
    except Exception as exc:
        raise RewardFuncError(f"reward_funcs {spec!r}: cannot import module {target!r}: "
                              f"{type(exc).__name__}: {exc}") from None


def example_columns(ex: dict) -> dict:
    """The dataset columns TRL passes reward functions for one normalised record: a prompt-only record's own
    (``solution``, ...), else ``answer``, the record's answer."""
    if "columns" in ex:
        return ex["columns"]
    return {ANSWER: ex["output"]} if "output" in ex else {}


def column_names(examples: list[dict] | None) -> list[str]:
    """Every column of ``examples`` in first-seen order (``answer`` for the built-in data, None)."""
    if examples is None:
        return [ANSWER]
    return list(dict.fromkeys(k for ex in examples for k in example_columns(ex)))


def column_values(examples: list[dict], names: list[str]) -> dict[str, list]:
    """Each column's values over ``examples`` (None where a record lacks it, as datasets fills a table)."""
    rows = [example_columns(ex) for ex in examples]
    return {name: [row.get(name) for row in rows] for name in names}


def check_builtin_columns(examples: list[dict] | None) -> None:
    """The built-in exact-answer reward reads ``answer``: refuse, naming the columns there are, records
    without one (TRL prompt-only data with its answer under another name)."""
    for i, ex in enumerate(examples or ()):
        if example_columns(ex).get(ANSWER) is None:
            have = ", ".join(f"`{k}`" for k in example_columns(ex)) or "none"
            raise RewardFuncError(f"record {i} has no `answer` column (its columns: {have}): the built-in "
                                  "exact-answer reward needs one; rename the answer's column to `answer` or give "
                                  "your own --reward-funcs file.py:name (it receives every column by name)")


def _check_signature(spec: str, func, columns: list[str]) -> None:
    """TRL calls ``func(prompts=..., completions=..., ..., **columns)``: it must take **kwargs, and every
    parameter without a default must be one TRL fills (its own arguments or a dataset column)."""
    try:
        params = list(inspect.signature(func).parameters.values())
    except (TypeError, ValueError):
        return  # a builtin or C callable without a signature: the trial call decides
    if not any(p.kind is p.VAR_KEYWORD for p in params):
        raise RewardFuncError(f"reward_funcs {spec!r}: must accept TRL's arguments (completions, **kwargs); "
                              "it has no **kwargs")
    filled = (*PASSED, *columns)
    for p in params:
        if p.kind is p.POSITIONAL_ONLY or (p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                                          and p.default is p.empty and p.name not in filled):
            raise RewardFuncError(f"reward_funcs {spec!r}: parameter {p.name!r} is not one TRL fills by name "
                                  f"(it passes {', '.join(PASSED)} and the data's columns: "
                                  f"{', '.join(columns) or 'none'}); give it a default or take it from **kwargs")


def load_reward_func(spec: str, columns: list[str] | None = None):
    """The callable a ``path.py:name`` or ``module:name`` spec names (signature checked against TRL's
    arguments and the data's ``columns``, default ``answer``)."""
    target, _, name = spec.strip().rpartition(":")
    module = _module_of(spec, target)
    if not hasattr(module, name):
        raise RewardFuncError(f"reward_funcs {spec!r}: {target} has no {name!r}")
    func = getattr(module, name)
    if not callable(func):
        raise RewardFuncError(f"reward_funcs {spec!r}: {name!r} is a {type(func).__name__}, not a function")
    _check_signature(spec, func, [ANSWER] if columns is None else columns)
    return func


def load_reward_funcs(config: TrainConfig, examples: list[dict] | None = None) -> list | None:
    """The round's reward callables in order, or None for the built-in rewards."""
    specs = reward_func_specs(config.reward_funcs)
    return [load_reward_func(s, column_names(examples)) for s in specs] if specs else None


def reward_kwargs(examples: list[dict], texts: list[str], columns: list[str] | None = None) -> dict:
    """TRL's keyword arguments for scoring ``texts``, the completions of ``examples`` (conversational): every
    column in ``columns`` (default: those of ``examples``) by its own name, as TRL passes dataset columns."""
    names = column_names(examples) if columns is None else columns
    return {
        **column_values(examples, names),
        "prompts": [prompt_messages(ex) for ex in examples],
        "completions": [[{"role": "assistant", "content": t}] for t in texts],
        "completion_ids": [[] for _ in texts],
        "trainer_state": None,
        "log_extra": lambda *a, **k: None,
        "log_metric": lambda *a, **k: None,
    }


def trial_call(spec: str, func, examples: list[dict] | None = None) -> None:
    """Call ``func`` once on two completions; RewardFuncError unless it returns one number per completion."""
    sample = list(examples or ())[:2]
    sample = sample if len(sample) == 2 else _SAMPLE
    right = example_columns(sample[0]).get(ANSWER)
    try:  # every column of the data, None where a sampled record lacks it (as TRL's table holds it)
        out = func(**reward_kwargs(sample, [str(right) if right is not None else "no idea", "no idea"],
                                   column_names(examples) if examples else None))
    except Exception as exc:
        raise RewardFuncError(f"reward_funcs {spec!r}: failed on a sample of 2 completions: "
                              f"{type(exc).__name__}: {exc}") from None
    if isinstance(out, str | bytes | dict) or not hasattr(out, "__len__"):
        raise RewardFuncError(f"reward_funcs {spec!r}: must return a list of floats, got {type(out).__name__}")
    if len(out) != 2:
        raise RewardFuncError(f"reward_funcs {spec!r}: returned {len(out)} values for 2 completions "
                              "(one per completion is needed)")
    bad = [v for v in out if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Real))]
    if bad:
        raise RewardFuncError(f"reward_funcs {spec!r}: must return floats (or None), got {bad[0]!r} "
                              f"({type(bad[0]).__name__})")


def check_reward_funcs(config: TrainConfig, examples: list[dict] | None = None) -> list | None:
    """Load the round's reward functions and call each once; the callables, or None for the built-ins (then
    every record needs the `answer` they read, unless a local reward model scores alone)."""
    specs = reward_func_specs(config.reward_funcs)
    funcs = [load_reward_func(s, column_names(examples)) for s in specs]
    for spec, func in zip(specs, funcs):
        trial_call(spec, func, examples)
    if not funcs and config.reward_model is None and config.stage in RL_STAGES:
        check_builtin_columns(examples)
    return funcs or None
