"""Client-side DP-SGD for ``sft`` and ``lora`` through Opacus.

DP-SGD: Abadi et al., "Deep Learning with Differential Privacy", CCS 2016 (per-example clipping,
Gaussian noise, Poisson sampling); accounting with Opacus's RDP accountant (Mironov, "Renyi
Differential Privacy", 2017). A small training loop in which Opacus owns the optimizer, the model and
the data loader. What is private: each training example of this client's local round, for this round's
steps. For ``sft`` only the Linear weights of the decoder blocks are trained under DP; the rest stays
frozen (its delta is exactly zero). Why this loop and not TRL's trainer: docs/design/privacy.md.
"""

from __future__ import annotations

import os
import pathlib
import time

import torch

from zoo_gym.evaluation.evaluate import Evaluator, collate, load_model, load_tokenizer, tokenize_examples

from .common import TrainResult, quiet_libraries, round_metadata, split_heldout
from .config import TrainConfig
from .delta import load_base_state
from .finetuning import delta_of, prepare
from .hardware import torch_device


def noise_for_epsilon(*, target_epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
    """Smallest noise multiplier whose RDP epsilon after ``steps`` stays within ``target_epsilon``."""
    from opacus.accountants.utils import get_noise_multiplier

    return float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta,
                                      sample_rate=sample_rate, steps=steps, accountant="rdp"))


def _freeze_for_dp_sft(model) -> None:
    for name, p in model.named_parameters():
        p.requires_grad_(False)
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{name}":
            module.weight.requires_grad_(True)
            if module.bias is not None:
                module.bias.requires_grad_(True)


def _per_example_loss(model, ids, mask, labels) -> torch.Tensor:
    """(B,) mean completion-token cross-entropy of each example."""
    logits = model(input_ids=ids, attention_mask=mask).logits  # (B, T, V)
    lg, lb = logits[:, :-1], labels[:, 1:]  # (B, T-1, V), (B, T-1)
    tok = torch.nn.functional.cross_entropy(lg.transpose(1, 2), lb, ignore_index=-100, reduction="none")  # (B, T-1)
    n = (lb != -100).sum(1).clamp(min=1)  # (B,)
    return tok.sum(1) / n


def _private_steps(dp_model, dp_opt, dp_loader, sched, engine, config: TrainConfig, *,
                   progress: bool, device: torch.device) -> tuple[int, int, int]:
    """``config.max_steps`` DP-SGD steps over the Poisson loader: (steps, examples seen, tokens seen)."""
    steps = examples_seen = tokens_seen = 0
    while steps < config.max_steps:
        for b_ids, b_mask, b_labels in dp_loader:
            if steps >= config.max_steps:
                break
            dp_opt.zero_grad(set_to_none=True)
            if b_ids.shape[0] > 0:
                b_ids, b_mask, b_labels = b_ids.to(device), b_mask.to(device), b_labels.to(device)
                loss = _per_example_loss(dp_model, b_ids, b_mask, b_labels).mean()
                loss.backward()
            dp_opt.step()  # an empty Poisson batch still adds noise and counts for the accountant
            sched.step()
            steps += 1
            examples_seen += int(b_ids.shape[0])
            tokens_seen += int(b_mask.sum())
            if progress and steps % max(1, config.max_steps // 10) == 0:
                print(f"dp step {steps}/{config.max_steps} eps={engine.get_epsilon(config.dp_delta):.3f}", flush=True)
    return steps, examples_seen, tokens_seen


def _entropy_generator(device) -> torch.Generator:
    """A generator seeded with 64 bits from os.urandom (Opacus's own secure mode needs torchcsprng, not on PyPI)."""
    return torch.Generator(device=device).manual_seed(int.from_bytes(os.urandom(8), "little"))


def train_dp(base_dir, examples, config: TrainConfig, *, base_sha256: str, eval_examples=None,
             progress: bool = False):
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    quiet_libraries(progress)
    torch.manual_seed(config.seed)
    base_dir = pathlib.Path(base_dir)
    train_ex, held = split_heldout(examples, eval_examples)
    names, base_state = load_base_state(base_dir)
    tokenizer = load_tokenizer(base_dir)
    device = torch_device(config)
    model = load_model(base_dir, attn_implementation=config.attn_implementation or "eager").to(device)
    loss_before = Evaluator(None, held, model=model, tokenizer=tokenizer).loss() if held else None

    model, initial = prepare(model, config)
    if config.finetuning_type == "full":
        _freeze_for_dp_sft(model)
    model.train()

    pairs = [(p, c) for p, c in tokenize_examples(tokenizer, train_ex)]
    pairs = [(p, c[: max(1, config.max_length - len(p))]) for p, c in pairs]
    ids, mask, labels = collate(pairs, pad_id=tokenizer.pad_token_id)  # (N, T) each
    n = ids.shape[0]
    sample_rate = min(1.0, config.batch_size / n)
    if config.dp_target_epsilon is not None:
        noise = noise_for_epsilon(target_epsilon=config.dp_target_epsilon, delta=config.dp_delta,
                                  sample_rate=sample_rate, steps=config.max_steps)
    else:
        noise = float(config.dp_noise_multiplier)

    # The Poisson batches (Opacus draws them from the loader's generator) and the noise come from the OS's entropy,
    # never from `config.seed`: the client sends its settings, seed included, with every upload, and a noise the
    # server could regenerate would be subtracted from the delta and protect nothing.
    loader = DataLoader(TensorDataset(ids, mask, labels), batch_size=config.batch_size,
                        generator=_entropy_generator("cpu"))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)
    engine = PrivacyEngine(accountant="rdp")
    noise_gen = _entropy_generator(device)  # opacus draws noise on the grads' device
    dp_model, dp_opt, dp_loader = engine.make_private(
        module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=noise,
        max_grad_norm=config.dp_max_grad_norm, poisson_sampling=True, grad_sample_mode="hooks",
        noise_generator=noise_gen,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / max(1, config.warmup_steps)) * max(0.0, 1.0 - s / config.max_steps),
    )
    t0 = time.perf_counter()
    steps, examples_seen, tokens_seen = _private_steps(dp_model, dp_opt, dp_loader, sched, engine, config,
                                                       progress=progress, device=device)
    seconds = time.perf_counter() - t0
    epsilon = float(engine.get_epsilon(config.dp_delta))

    model = dp_model._module
    model.eval()
    loss_after = Evaluator(None, held, model=model, tokenizer=tokenizer).loss() if held else None
    delta = delta_of(model, config, base_state, names, initial=initial)
    meta = round_metadata(config, delta, base_sha256=base_sha256, **{
        "steps": steps,
        "examples_seen": examples_seen,
        "tokens_seen": tokens_seen,
        "train_seconds": round(seconds, 3),
        "loss_before": loss_before,
        "loss_after": loss_after,
        "heldout_examples": len(held) if held else 0,
        "epsilon": epsilon,
        "dp_delta": config.dp_delta,
        "dp_noise_multiplier": noise,
        "dp_max_grad_norm": config.dp_max_grad_norm,
        "dp_sample_rate": sample_rate,
        "dp_accountant": "rdp",
        "dp_unit": "example",
    })
    return TrainResult(delta=delta, base_sha256=base_sha256, metadata=meta)
