"""BitDelta scale distillation: the calibration step of Liu et al., "BitDelta: Your Fine-Tune May Only
Be Worth One Bit", 2024 (arXiv:2402.10193), Section 3.2.

Freezes the signs and the base and trains only the per-group scales, so that the logits of
``base + scale * sign`` match those of ``base + delta`` (mean squared error over the calibration tokens).
The output is a DENSE delta equal to ``scale * sign``: re-encoding it with ``zoo_gym.codec`` bitdelta at
the same ``group_size`` reproduces the distilled scales. Signs follow the codec (``x >= 0`` is +); 1-D
tensors pass through unchanged. Details: docs/design/training.md.
"""

from __future__ import annotations

import pathlib
from collections.abc import Mapping

import torch

from zoo_gym.evaluation.evaluate import collate, dense_delta, load_model, load_tokenizer, tokenize_examples

DEFAULT_DISTILL_STEPS = 50  # a variant's calibration steps (gym-client personalize, join --keep-variant)


def _view2d(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1)


def group_mean_abs(x2d: torch.Tensor, *, group_size: int | None) -> torch.Tensor:
    """Mean |x| per scale group of a (rows, cols) tensor -> (scale_rows, n_groups), as the codec groups."""
    rows, cols = x2d.shape
    a = x2d.abs().double()
    if group_size == -1:
        return a.mean().reshape(1, 1).float()
    if group_size is None or group_size >= cols:
        return a.mean(dim=1, keepdim=True).float()
    if group_size <= 0:
        raise ValueError(f"`group_size` must be > 0, None (per row) or -1 (per tensor), got {group_size}")
    n_groups = -(-cols // group_size)
    pad = n_groups * group_size - cols
    s = torch.nn.functional.pad(a, (0, pad)).reshape(rows, n_groups, group_size).sum(-1)  # (rows, n_groups)
    counts = torch.full((n_groups,), float(group_size), dtype=torch.float64, device=x2d.device)
    counts[-1] = cols - (n_groups - 1) * group_size
    return (s / counts).float()


def expand_scales(scales: torch.Tensor, *, rows: int, cols: int, group_size: int | None) -> torch.Tensor:
    """(scale_rows, n_groups) -> (rows, cols), each scale repeated over its group."""
    if scales.shape[1] == 1:
        return scales.expand(rows, cols)
    g = group_size
    full = scales.repeat_interleave(g, dim=1)[:, :cols]  # (scale_rows, cols)
    return full.expand(rows, cols)


def _check_settings(*, steps: int, lr: float, calib_examples: list[dict]) -> None:
    if steps < 0:
        raise ValueError(f"`steps` must be >= 0, got {steps}")
    if not lr > 0:
        raise ValueError(f"`lr` must be > 0, got {lr}")
    if not calib_examples:
        raise ValueError("`calib_examples` must not be empty: distillation matches logits on them")


def _signs_and_initial_scales(dense: dict, params: dict, base_dir, group_size: int | None):
    """Frozen signs, trainable scales (the codec's group mean |x|) and shapes of the 2-D+ tensors;
    1-D tensors go to the pass-through dict. Refuses a name that is not a parameter of the base."""
    signs, scales, shapes, passthrough = {}, {}, {}, {}
    for k, d in dense.items():
        if k not in params:
            raise KeyError(f"delta names {k!r}, which is not a parameter of the base in {base_dir}")
        if d.dim() < 2:
            passthrough[k] = d
            continue
        x = _view2d(d)
        signs[k] = torch.where(x >= 0, 1.0, -1.0)  # (rows, cols), frozen
        scales[k] = torch.nn.Parameter(group_mean_abs(x, group_size=group_size))  # (scale_rows, n_groups)
        shapes[k] = d.shape
    return signs, scales, shapes, passthrough


def distill_bitdelta_scales(
    base_dir,
    delta: Mapping[str, torch.Tensor],
    *,
    group_size: int | None,
    calib_examples: list[dict],
    steps: int = DEFAULT_DISTILL_STEPS,
    lr: float = 1e-4,
    batch_size: int = 32,
    generator: torch.Generator | None = None,
    device: str | torch.device = "cpu",
) -> dict[str, torch.Tensor]:
    """Distilled ``scale * sign`` for every 2-D+ tensor of ``delta`` (dense float32, on the CPU); 1-D ones
    unchanged. The base, the signs, the scales and the teacher's logits live on ``device`` (float32 there too)."""
    _check_settings(steps=steps, lr=lr, calib_examples=calib_examples)
    base_dir = pathlib.Path(base_dir)
    tokenizer = load_tokenizer(base_dir)
    model = load_model(base_dir).to(device)
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    params = dict(model.named_parameters())

    dense = {k: dense_delta(v).float().to(device) for k, v in delta.items()}
    signs, scales, shapes, passthrough = _signs_and_initial_scales(dense, params, base_dir, group_size)

    pairs = tokenize_examples(tokenizer, calib_examples)
    batches = [tuple(t.to(device) for t in collate(pairs[i:i + batch_size], pad_id=tokenizer.pad_token_id))
               for i in range(0, len(pairs), batch_size)]

    def weights(student: bool) -> dict[str, torch.Tensor]:
        out = {}
        for k, p in params.items():
            if k in scales and student:
                rows, cols = signs[k].shape
                q = expand_scales(scales[k], rows=rows, cols=cols, group_size=group_size) * signs[k]
                out[k] = p + q.reshape(shapes[k])
            elif k in dense:
                out[k] = p + dense[k]
        return out

    from torch.func import functional_call

    with torch.no_grad():
        teacher_w = weights(student=False)
        targets = [functional_call(model, teacher_w, args=(), kwargs={"input_ids": ids, "attention_mask": m}).logits
                   for ids, m, _ in batches]  # each (B, T, V)
    opt = torch.optim.Adam(list(scales.values()), lr=lr)
    order = torch.randperm(len(batches), generator=generator) if generator is not None else None
    for step in range(steps):
        j = int(order[step % len(batches)]) if order is not None else step % len(batches)
        ids, m, _ = batches[j]
        logits = functional_call(model, weights(student=True), args=(),
                                 kwargs={"input_ids": ids, "attention_mask": m}).logits  # (B, T, V)
        mask = m.unsqueeze(-1).float()  # (B, T, 1)
        loss = (((logits - targets[j]) ** 2) * mask).sum() / (mask.sum() * logits.shape[-1])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        with torch.no_grad():
            for s in scales.values():
                s.clamp_(min=1e-12)  # scales stay positive, as the codec requires

    out = dict(passthrough)
    with torch.no_grad():
        for k in scales:
            rows, cols = signs[k].shape
            q = expand_scales(scales[k].detach(), rows=rows, cols=cols, group_size=group_size) * signs[k]
            out[k] = q.reshape(shapes[k]).contiguous()
    return {k: out[k].cpu() for k in dense}
