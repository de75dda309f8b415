"""Can a contributor train this base? One real LoRA step, checked before a federation starts on it.

``check_trainable`` runs ``train()`` exactly as a client does (TRL's SFTTrainer, PEFT LoRA, the
checkpoint's chat template) for one optimizer step on two examples, then checks that the delta names
only weights of the base, in the base's shapes, and is finite. Any failure becomes one ``PreflightError``
sentence naming the cause, so ``gym-server init`` refuses the base instead of every client failing later.
"""

from __future__ import annotations

import contextlib
import io
import pathlib
import warnings

import torch


class PreflightError(RuntimeError):
    """This base cannot be trained (or evaluated) the way the federation needs; the message says why."""


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}".rstrip(": ")


def check_template(model_dir: str | pathlib.Path) -> None:
    """PreflightError unless the checkpoint's tokenizer renders prompt/completion pairs."""
    from zoo_gym.evaluation.chat import ChatTemplateError, check_template as check
    from zoo_gym.evaluation.evaluate import load_tokenizer

    try:
        check(load_tokenizer(model_dir))
    except ChatTemplateError as exc:
        raise PreflightError(str(exc)) from None
    except Exception as exc:  # noqa: BLE001 - a tokenizer that does not load at all
        raise PreflightError(f"its tokenizer does not load: {_first_line(exc)}") from None


def check_vocabulary(model_dir: pathlib.Path, examples: list[dict]) -> None:
    """PreflightError when the tokenizer gives ids past the model's embedding table."""
    from transformers import AutoConfig

    from zoo_gym.evaluation.evaluate import load_tokenizer, tokenize_examples

    try:
        vocab = AutoConfig.from_pretrained(str(model_dir)).get_text_config().vocab_size
    except Exception as exc:  # noqa: BLE001 - a config that does not load: say so
        raise PreflightError(f"its config.json does not load: {_first_line(exc)}") from None
    tok = load_tokenizer(model_dir)
    top = max(max(p + c) for p, c in tokenize_examples(tok, examples))
    if vocab is not None and top >= vocab:
        raise PreflightError(f"its tokenizer gives token id {top} but the model has only {vocab} embeddings "
                             "(vocab_size in config.json); use the tokenizer the model was trained with")


def check_trainable(model_dir: str | pathlib.Path, examples: list[dict], *, bf16: bool = False) -> None:
    """One LoRA step of ``train()`` on the first two of ``examples`` (as a ``--bf16`` client with `bf16`);
    PreflightError when it cannot run or its delta does not fit the base."""
    from .config import TrainConfig
    from .delta import base_parameter_names
    from zoo_gym.evaluation.evaluate import dense_delta
    from .train import train

    model_dir = pathlib.Path(model_dir)
    check_template(model_dir)
    examples = list(examples)[:2]
    if not examples:
        raise PreflightError("no examples to try a training step on")
    check_vocabulary(model_dir, examples)
    cfg = TrainConfig(method="lora", max_steps=1, batch_size=len(examples), warmup_steps=0, bf16=bf16)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")  # deprecations and PEFT's Conv1D notice are not the operator's
            result = train(model_dir, examples, cfg, base_sha256="preflight", eval_examples=[])
    except Exception as exc:  # noqa: BLE001 - whatever breaks a client's first step breaks it here
        raise PreflightError(f"one LoRA training step fails: {_first_line(exc)}") from None
    shapes = base_parameter_names(model_dir)
    if not result.delta:
        raise PreflightError("LoRA found no layers to adapt (target_modules='all-linear' matched nothing)")
    for name, value in result.delta.items():
        d = dense_delta(value)
        if name not in shapes:
            raise PreflightError(f"a LoRA delta names {name!r}, which is not a tensor of the base checkpoint")
        if tuple(d.shape) != tuple(shapes[name]):
            raise PreflightError(f"the LoRA delta of {name!r} has shape {list(d.shape)}, the base has "
                                 f"{list(shapes[name])}")
        if not bool(torch.isfinite(d).all()):
            raise PreflightError(f"one LoRA training step gives non-finite values in {name!r}")
