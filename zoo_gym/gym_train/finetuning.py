"""Which weights a round trains (``finetuning_type``), and what delta they send.

``prepare(model, config)`` turns the loaded base into the model to train and returns the initial
state a delta must subtract (PiSSA-style adapter inits), or None. ``delta_of(...)`` turns the trained
model into the delta against the base: LoRA factors (or a merged dense delta), or dense ``fine - base``
for the types that change weights in place.
"""

from __future__ import annotations

from .common import with_lora
from .config import TrainConfig
from .delta import adapter_delta, dense_delta_from_models


def prepare(model, config: TrainConfig):
    """(model to train, initial adapter state or None) for ``config.finetuning_type``."""
    kind = config.finetuning_type
    if kind == "lora":
        return with_lora(model, config)
    if kind == "full":
        return model, None
    raise NotImplementedError(f"finetuning_type {kind!r} is not available in this build")


def delta_of(model, config: TrainConfig, base_state, names, *, initial=None) -> dict:
    """The delta a finished round sends, keyed by the base checkpoint's parameter names."""
    if config.finetuning_type == "lora":
        return adapter_delta(model, config, base_state, names, initial=initial)
    return dense_delta_from_models(base_state, model, names)
