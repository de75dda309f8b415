"""Preference stages (dpo, kto, orpo, simpo) through TRL's trainers."""

from __future__ import annotations


def train_preference(base_dir, examples, config, *, base_sha256: str, eval_examples=None, progress: bool = False):
    raise NotImplementedError(f"stage {config.stage!r} is not available in this build")
