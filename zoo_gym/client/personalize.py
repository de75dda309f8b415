"""A personal variant: train on your own data with no server, distil the BitDelta scales, write ``NAME.zgd``.

Training is ``gym-client join``'s (same TrainConfig, flags, ``--config`` file and data formats); the
delta against the base is then coded as 1-bit signs with one scale per group of 128 along each row,
and the scales are distilled (Liu et al., "BitDelta", 2024, Section 3.2: signs frozen, scales trained
so the variant's logits match the fine-tuned model's on your examples). The file is a codec payload
whose metadata names the base's weights sha256 (``zoo_gym.serving.variant``), so ``gym-serve`` refuses
it over any other base. With ``peft_out`` the trained LoRA factors are also written as a PEFT adapter
(zoo_gym.serving.peft_adapter): the exact trained delta, which the 1-bit file only approximates.
"""

from __future__ import annotations

import logging
import pathlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from zoo_gym.gym_train.distill import DEFAULT_DISTILL_STEPS
from zoo_gym.serving.variant import SUFFIX, check_name, encode_variant, resolve_base_dir, weights_sha256, write_variant

GROUP_SIZE = 128
CALIBRATION_EXAMPLES = 64  # examples the scale distillation matches logits on


class PersonalizeError(ValueError):
    """The variant cannot be made; the message says why and what to do."""


@dataclass
class PersonalizeOptions:
    data: str
    base: str  # a Hugging Face directory, a hub id in the local cache, or 'tiny'
    out: pathlib.Path
    task: str | None = None  # built-in task family for data "builtin" (None: the stage's, tasks.builtin_task)
    method: str | None = None  # deprecated: stage and finetuning_type in train_overrides
    train_overrides: dict = field(default_factory=dict)  # TrainConfig keywords
    distill_steps: int = DEFAULT_DISTILL_STEPS  # 0: keep the mean-|delta| scales
    progress: bool = False
    peft_out: pathlib.Path | None = None  # also write the LoRA factors as a PEFT adapter directory


def variant_name(out: pathlib.Path) -> str:
    if out.suffix != SUFFIX:
        raise PersonalizeError(f"--out {out}: a variant file is NAME{SUFFIX}")
    return check_name(out.name.removesuffix(SUFFIX))


def save_variant(base_dir: pathlib.Path, delta: dict, out: pathlib.Path, *, calib_examples: list[dict],
                 distill_steps: int, info: dict, device: str = "auto") -> dict:
    """Distil the scales (when ``distill_steps``, on ``device``: TrainConfig.device's values) and write the
    variant; return its summary."""
    from zoo_gym.gym_train.distill import distill_bitdelta_scales
    from zoo_gym.evaluation.evaluate import dense_delta

    t0 = time.perf_counter()
    if distill_steps > 0:
        import torch

        from zoo_gym.gym_train.hardware import resolve_device

        def distill(on):
            return distill_bitdelta_scales(base_dir, delta, group_size=GROUP_SIZE, steps=distill_steps,
                                           calib_examples=calib_examples[:CALIBRATION_EXAMPLES], device=on)

        on = resolve_device(device)
        try:
            delta = distill(on)
        except torch.OutOfMemoryError:  # the teacher's logits of every calibration batch stay on the device
            if on.type == "cpu":
                raise
            torch.cuda.empty_cache()
            logging.getLogger(__name__).warning("variant %s: distilling on %s ran out of memory; distilling on "
                                                "the CPU", out.name, on)
            delta = distill(torch.device("cpu"))
    else:
        delta = {k: dense_delta(v) for k, v in delta.items()}
    sha = weights_sha256(base_dir)
    payload = encode_variant(delta, base_sha256=sha, group_size=GROUP_SIZE,
                             info={**info, "distill_steps": distill_steps, "group_size": GROUP_SIZE})
    write_variant(out, payload)
    return {"variant": out.name.removesuffix(SUFFIX), "path": str(out), "bytes": len(payload), "base_sha256": sha,
            "distill_seconds": round(time.perf_counter() - t0, 3)}


def keep_round_variant(delta: dict, model_dir: pathlib.Path, *, out: pathlib.Path, checkpoint_sha256: str,
                       calib_examples: list[dict], say: Callable[[str], None] = print,
                       distill_steps: int = DEFAULT_DISTILL_STEPS, device: str = "auto") -> dict:
    """`join --keep-variant`: a contributor's own round delta as a variant over the round's base (distilled on
    the device the rounds trained on)."""
    summary = save_variant(model_dir, delta, out, calib_examples=calib_examples, distill_steps=distill_steps,
                           info={"base": "federation checkpoint", "checkpoint_sha256": checkpoint_sha256},
                           device=device)
    say(f"kept this round's delta as variant {out} ({summary['bytes']} bytes)")
    return summary


def _write_peft(delta: dict, opts: PersonalizeOptions, base_dir: pathlib.Path, sha: str, *,
                say: Callable[[str], None]) -> None:
    from zoo_gym.proto.model_card import public_base_name
    from zoo_gym.serving.peft_adapter import write_peft_adapter

    try:
        write_peft_adapter(delta, opts.peft_out, base_dir=base_dir, base_sha256=sha,
                           base_name=public_base_name(str(opts.base), base_dir))
    except ValueError as exc:
        raise PersonalizeError(f"--peft-out: {exc}; train with --finetuning-type lora") from None
    say(f"wrote the LoRA factors as a PEFT adapter in {opts.peft_out}")


def _builtin(task: str | None, stage: str) -> list[dict]:
    """256 examples of built-in ``task`` (default: the stage's), refused in one line if it does not fit the stage."""
    from zoo_gym.gym_train.tasks import builtin_examples, builtin_task, check_task_stage

    name = task or builtin_task(stage)
    try:
        check_task_stage(name, stage)
    except ValueError as exc:
        raise PersonalizeError(f"--task: {exc}") from None
    return builtin_examples(name, shard=0, n_shards=1, n=256)


def personalize(opts: PersonalizeOptions, *, say: Callable[[str], None] = print) -> dict:
    """Train, distil and write ``opts.out``; return a summary dict."""
    from zoo_gym import gym_train
    from zoo_gym.client.train_settings import check_round
    from zoo_gym.proto.model_card import base_label

    name = variant_name(opts.out)
    if opts.peft_out is not None and opts.peft_out.exists() and any(opts.peft_out.iterdir()):
        raise PersonalizeError(f"--peft-out {opts.peft_out} exists and is not empty")
    if opts.distill_steps < 0:
        raise PersonalizeError("--distill-steps must be >= 0")
    try:
        base_dir = resolve_base_dir(opts.base)
    except ValueError as exc:
        raise PersonalizeError(f"--base: {exc}") from None
    config = gym_train.TrainConfig(**({"method": opts.method} if opts.method else {}), **opts.train_overrides)
    if opts.data == "builtin":
        examples = _builtin(opts.task, config.stage)
    elif opts.task is not None:
        raise PersonalizeError("--task picks built-in data; it does not apply with --data FILE")
    else:
        examples = gym_train.load_examples(opts.data, allow_text=True)
    examples = examples[:config.max_samples]  # None: all
    if len(examples) < 2:
        raise PersonalizeError(f"{opts.data}: {len(examples)} example(s); at least 2 are needed")
    config = check_round(config, n_train=len(examples))
    sha = weights_sha256(base_dir)
    say(f"training {name} ({config.label}, {config.max_steps} steps) on {len(examples)} examples over base "
        f"{base_dir} ({base_label(base_dir, sha)})")
    result = gym_train.train(base_dir, examples, config, base_sha256=sha, progress=opts.progress)
    meta = result.metadata
    if opts.peft_out is not None:
        _write_peft(result.delta, opts, base_dir, sha, say=say)
    say(f"trained in {meta.get('train_seconds')} s; distilling the 1-bit scales ({opts.distill_steps} steps)")
    summary = save_variant(base_dir, result.delta, opts.out, calib_examples=examples,
                           distill_steps=opts.distill_steps, device=config.device,
                           info={"base": str(opts.base), "training": {k: meta.get(k) for k in (
                               "method", "steps", "loss_before", "loss_after", "seed")}})
    summary.update(loss_before=meta.get("loss_before"), loss_after=meta.get("loss_after"), steps=meta.get("steps"))
    say(f"wrote {opts.out} ({summary['bytes']} bytes) for base {base_label(base_dir, sha)}")
    return summary
