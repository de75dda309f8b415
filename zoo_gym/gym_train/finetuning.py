"""Which weights a round trains (``finetuning_type``), and what delta they send.

``prepare(model, config)`` turns the loaded base into the model to train and returns the initial
state a delta must subtract (PiSSA-style adapter inits), or None. ``delta_of(...)`` turns the trained
model into the delta against the original base, keyed by its parameter names: LoRA factors (or a merged
dense delta; LoftQ's always is, as it also changes the base weights), OFT's merged dense delta, dense
``fine - base`` for full, and for freeze only the parameters of the trained layers (the server accepts
any subset of the base's names; the others are exactly zero).
"""

from __future__ import annotations

import re

from .common import with_lora
from .config import TrainConfig
from .delta import adapter_delta, dense_delta_from_models, merged_lora_delta

_LAYER = re.compile(r"\.layers\.(\d+)\.(.+)$")


def prepare(model, config: TrainConfig):
    """(model to train, initial adapter state or None) for ``config.finetuning_type``."""
    kind = config.finetuning_type
    if kind == "lora":
        return with_lora(model, config)
    if kind == "full":
        return model, None
    if kind == "freeze":
        return freeze_layers(model, config), None
    if kind == "oft":
        return with_oft(model, config), None
    raise NotImplementedError(f"finetuning_type {kind!r} is not available in this build")


def trainable_layer_ids(n_layers: int, n: int) -> list[int]:
    """The last ``n`` of ``n_layers`` layers, or the first ``|n|`` when n < 0 (LLaMA-Factory's rule)."""
    if abs(n) > n_layers:
        raise ValueError(f"`freeze_trainable_layers` is {n} but the model has {n_layers} layers")
    return list(range(n_layers - n, n_layers)) if n > 0 else list(range(-n))


def freeze_layers(model, config: TrainConfig):
    """Freeze every parameter except those of the chosen layers' chosen modules; returns the model."""
    ids = set(trainable_layer_ids(model.config.num_hidden_layers, config.freeze_trainable_layers))
    wanted = [m.strip() for m in config.freeze_trainable_modules.split(",") if m.strip()]
    seen: set[str] = set()
    for name, p in model.named_parameters():
        m = _LAYER.search(name)
        inside = m is not None and int(m.group(1)) in ids
        if inside:
            seen.add(m.group(2).split(".")[0])
        p.requires_grad_(inside and ("all" in wanted or any(m.group(2).startswith(w + ".") for w in wanted)))
    unknown = [w for w in wanted if w != "all" and w not in seen]
    if unknown:
        raise ValueError(f"`freeze_trainable_modules`: no module {unknown} in the layers; "
                         f"they have {sorted(seen)}")
    return model


def with_oft(model, config: TrainConfig):
    """PEFT OFT (block-diagonal orthogonal rotations of the target Linears)."""
    from peft import OFTConfig, get_peft_model

    oft = OFTConfig(r=0, oft_block_size=config.oft_block_size, target_modules=config.target_modules,
                    module_dropout=config.lora_dropout, bias="none", task_type="CAUSAL_LM")
    return get_peft_model(model, oft)


def delta_of(model, config: TrainConfig, base_state, names, *, initial=None) -> dict:
    """The delta a finished round sends, keyed by the base checkpoint's parameter names."""
    kind = config.finetuning_type
    if kind == "lora" and config.init_lora_weights == "loftq":
        # LoftQ replaced W by Q(W) and set B0 A0 ~ W - Q(W): merged - W is the whole change (dense)
        return merged_lora_delta(model, base_state, names)
    if kind == "lora":
        return adapter_delta(model, config, base_state, names, initial=initial)
    if kind == "oft":
        return merged_lora_delta(model, base_state, names)
    if kind == "freeze":
        trained = {n for n, p in model.named_parameters() if p.requires_grad}
        names = [n for n in names if n in trained]
    return dense_delta_from_models(base_state, model, names)
