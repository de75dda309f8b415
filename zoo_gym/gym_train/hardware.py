"""Checks that fail at once, in one sentence, when the machine cannot do what the config asks."""

from __future__ import annotations

import importlib.util
import pathlib

import torch

from .errors import HardwareError
from .qlora import check_qlora


def torch_device(config) -> torch.device:
    """The device a run trains on: the one named, or for 'auto' a CUDA GPU when present, else the CPU."""
    return resolve_device(config.device)


def resolve_device(name: str) -> torch.device:
    """`TrainConfig.device`'s value as a torch device: 'auto' is a CUDA GPU when present, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


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


# option -> (package it needs, what it is): refused without CUDA, passed through with it
CUDA_ONLY = {"use_liger_kernel": ("liger_kernel", "Liger's Triton kernels"),
             "use_unsloth": ("unsloth", "Unsloth's Triton kernels")}


def check_cuda_options(config) -> None:
    """Raise HardwareError, one line each, for options that need CUDA (and their package) on a machine without."""
    for name, (package, what) in CUDA_ONLY.items():
        if not getattr(config, name):
            continue
        if not torch.cuda.is_available():
            raise HardwareError(f"{name} needs a CUDA GPU ({what}) and this machine has none; leave it off on a CPU.")
        if importlib.util.find_spec(package) is None:
            raise HardwareError(f"{name} needs the {package.replace('_', '-')} package: "
                                f"pip install {package.replace('_', '-')} on a CUDA machine.")
    if config.init_lora_weights == "loftq":
        if not torch.cuda.is_available():
            raise HardwareError("init_lora_weights='loftq' needs a CUDA GPU: PEFT's LoftQ quantizes on 'cuda'; "
                                "use pissa or the default init on a CPU.")
        if importlib.util.find_spec("bitsandbytes") is None:
            raise HardwareError("init_lora_weights='loftq' needs bitsandbytes: pip install 'zoo-gym[qlora]'.")


def check_hardware(config, base_dir: pathlib.Path | None = None) -> None:
    """Raise HardwareError before any work when the config asks for something this machine lacks."""
    check_cuda_options(config)
    if config.attn_implementation == "flash_attention_2":
        check_flash_attention()
    if config.quantization == "4bit":
        check_qlora(base_dir)
