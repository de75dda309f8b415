"""Checks that fail at once, in one sentence, when the machine cannot do what the config asks."""

from __future__ import annotations

import importlib.util
import pathlib

import torch

from .errors import HardwareError
from .qlora import check_qlora


def check_flash_attention() -> None:
    if not torch.cuda.is_available():
        raise HardwareError(
            "attn_implementation='flash_attention_2' needs a CUDA GPU and this machine has none; "
            "leave attn_implementation unset (PyTorch SDPA) on a CPU."
        )
    if importlib.util.find_spec("flash_attn") is None:
        raise HardwareError(
            "attn_implementation='flash_attention_2' needs the flash-attn package: "
            "pip install 'zoo-gym[flash]' on a CUDA machine, or leave attn_implementation unset."
        )


def check_hardware(config, base_dir: pathlib.Path | None = None) -> None:
    """Raise HardwareError before any work when the config asks for something this machine lacks."""
    if config.attn_implementation == "flash_attention_2":
        check_flash_attention()
    if config.quantization == "4bit":
        check_qlora(base_dir)
