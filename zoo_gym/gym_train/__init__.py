"""Local training for Zoo Gym: the built-in tiny model and data, SFT / LoRA / GRPO through TRL and
PEFT, client-side DP-SGD, BitDelta scale distillation and error feedback.

Nothing heavy is imported here at import time beyond torch; TRL/PEFT load inside ``train``.
"""

from __future__ import annotations

import pathlib

from zoo_gym.evaluation.evaluate import Evaluator, heldout_loss

from .common import TrainResult
from .config import TrainConfig, TrainConfigError
from .errors import DataError, HardwareError
from .formats import check_stage_data, load_examples
from .tasks import builtin_examples, builtin_task, default_validation_examples
from .train import train


def tiny_model_dir() -> pathlib.Path:
    """The shipped Hugging Face directory of the built-in tiny base model."""
    return pathlib.Path(__file__).resolve().parent / "tiny"


def __getattr__(name: str):
    # the lighter-used parts load on first use
    if name == "ErrorFeedback":
        from .error_feedback import ErrorFeedback

        return ErrorFeedback
    if name == "distill_bitdelta_scales":
        from .distill import distill_bitdelta_scales

        return distill_bitdelta_scales
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "DataError",
    "ErrorFeedback",
    "Evaluator",
    "HardwareError",
    "TrainConfig",
    "TrainConfigError",
    "TrainResult",
    "builtin_examples",
    "builtin_task",
    "check_stage_data",
    "default_validation_examples",
    "distill_bitdelta_scales",
    "heldout_loss",
    "load_examples",
    "tiny_model_dir",
    "train",
]
