"""Keys of LLaMA-Factory's and TRL's/transformers' configs that the server or the client decides instead.

``DECIDED`` maps such a key to its one-line reason; ``DISTRIBUTED`` keys (and ``DISTRIBUTED_PREFIXES``)
name multi-process training, which does not apply to one contributor's local round. ``set_aside(values,
settings)`` returns (the values left for the settings, one warning per set-aside key). A key that is a
setting (a TrainConfig field or alias) is never set aside; a key known nowhere stays for the caller to
refuse; a set-aside key whose value is null asks nothing and is dropped without a warning.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

_MODEL = "the model is the server's current checkpoint, downloaded every round"
_CHECKPOINTS = "the client keeps no checkpoints: each round's delta is uploaded to the server"
_DATA = "--data decides the examples (default: your shard of the built-in data)"
_EVAL = ("the client holds out its own evaluation set (a tenth of your examples, at most 64) and reports its "
         "loss before and after the round")
_PREPROCESS = "the client prepares your examples in memory, in one process, every round (no cache, no workers)"

DECIDED: dict[str, str] = {
    "model_name_or_path": _MODEL,
    "adapter_name_or_path": _MODEL + " (a round starts from it, not from a local adapter)",
    "template": "the chat template is the checkpoint's own (its tokenizer's)",
    "trust_remote_code": "the client loads the server's checkpoint with transformers' own model code",
    "do_train": "gym-client join always trains, one round per server round",
    "output_dir": _CHECKPOINTS,
    "overwrite_output_dir": _CHECKPOINTS,
    "save_steps": _CHECKPOINTS,
    "save_strategy": _CHECKPOINTS,
    "save_total_limit": _CHECKPOINTS,
    "save_only_model": _CHECKPOINTS,
    "resume_from_checkpoint": _CHECKPOINTS + "; every round starts from the server's checkpoint",
    "dataset": _DATA,
    "dataset_dir": _DATA,
    "overwrite_cache": _PREPROCESS,
    "preprocessing_num_workers": _PREPROCESS,
    "dataloader_num_workers": _PREPROCESS,
    "plot_loss": "the client reports the held-out loss before and after each round (report_to draws curves)",
    "do_eval": _EVAL,
    "eval_dataset": _EVAL,
    "val_size": _EVAL,
    "per_device_eval_batch_size": _EVAL,
    "eval_strategy": _EVAL,
    "evaluation_strategy": _EVAL,
    "eval_steps": _EVAL,
    "run_name": "the server names each round (its round id)",
    "push_to_hub": "the delta goes to the server, never to the Hub (gym-client pull downloads the published "
                   "checkpoint)",
    "hub_model_id": "the delta goes to the server, never to the Hub",
    "logging_dir": "report_to tensorboard writes under $TENSORBOARD_LOGGING_DIR (default ./runs)",
    "max_prompt_length": "each example, prompt and answer together, is cut at max_length (cutoff_len)",
}
_DISTRIBUTED_REASON = ("does not apply: a contributor trains its own round in one local process (no DeepSpeed, "
                       "FSDP, DDP or Ray)")
DISTRIBUTED = ("deepspeed", "fsdp", "local_rank", "ddp_timeout", "ddp_backend", "accelerator_config")
DISTRIBUTED_PREFIXES = ("ddp_", "fsdp_", "ray_")


def reason(key: str) -> str | None:
    """Why `key` (normalised: underscores, lower case) is not taken from the file, or None if it is unknown."""
    if key in DECIDED:
        return f"not used here: {DECIDED[key]}"
    if key in DISTRIBUTED or key.startswith(DISTRIBUTED_PREFIXES):
        return _DISTRIBUTED_REASON
    return None


def set_aside(values: Mapping[str, Any], settings: Collection[str]) -> tuple[dict[str, Any], list[str]]:
    """(`values` less the keys the server or client decides, one warning line per such key given a value)."""
    kept: dict[str, Any] = {}
    warnings: list[str] = []
    for key, value in values.items():
        name = str(key).strip().replace("-", "_")
        why = None if name in settings else reason(name)
        if why is None:
            kept[key] = value
        elif value is not None:
            warnings.append(f"`{key}` {why}")
    return kept, warnings
