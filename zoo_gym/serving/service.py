"""The pieces of one gym-serve process, built from its options (no work at import time)."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from zoo_gym.serving.batcher import Batcher
from zoo_gym.serving.model import MultiVariantModel
from zoo_gym.proto.model_card import base_label
from zoo_gym.serving.registry import VariantRegistry
from zoo_gym.gym_train.bases import BUILTIN_BASES
from zoo_gym.serving.variant import resolve_base_dir, weights_sha256

log = logging.getLogger("zoo_gym.serving")


@dataclass
class ServeOptions:
    base: str
    variants: str | None = None
    max_variant_bytes: int | None = None
    window_ms: float = 5.0  # how long a batch waits for more requests
    max_batch: int = 16
    max_tokens: int = 512  # the most a request may ask to generate
    device: str = "cpu"
    dtype: str = "float32"
    base_name: str | None = None  # the `model` id of the base alone [default: the base's directory name]


class Service:
    def __init__(self, opts: ServeOptions) -> None:
        from transformers import AutoTokenizer

        self.opts = opts
        self.base_dir = resolve_base_dir(opts.base)
        self.base_sha256 = weights_sha256(self.base_dir)
        self.base_name = opts.base_name or (opts.base if opts.base in BUILTIN_BASES else self.base_dir.name)
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.base_dir))
        self.model = MultiVariantModel.from_dir(self.base_dir, dtype=getattr(torch, opts.dtype), device=opts.device)
        self.registry = VariantRegistry(opts.variants, base_sha256=self.base_sha256,
                                        max_bytes=opts.max_variant_bytes, check=self.model.check,
                                        prepare=self.model.on_device)
        cfg = self.model.model.config
        self.context = int(getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", 2048))
        eos = getattr(self.model.model.generation_config, "eos_token_id", None) or self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        pad = self.tokenizer.pad_token_id
        self.batcher = Batcher(self.model, self.registry, eos_ids=self.eos_ids,
                               pad_id=pad if pad is not None else (min(self.eos_ids) if self.eos_ids else 0),
                               window_s=opts.window_ms / 1000, max_batch=opts.max_batch)
        log.info("serving base %s (%s) with %d variant(s) in %s", self.base_name,
                 base_label(self.base_dir, self.base_sha256), len(self.registry.names()), opts.variants)

    def start(self) -> None:
        self.batcher.start()

    def stop(self) -> None:
        self.batcher.stop()
