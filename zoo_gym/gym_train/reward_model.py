"""A reward model from a local directory (``TrainConfig.reward_model``), for the RL stages.

The directory holds a sequence-classification checkpoint with one label and its tokenizer (with a chat
template), as TRL's GRPO/RLOO trainers take in ``reward_funcs``; nothing is downloaded. ``check_reward_model``
reads the config and tokenizer only and raises :class:`RewardModelError` (one line naming the path);
``RewardModel`` loads it: TRL trains on ``.model`` with ``.tokenizer``, and calling it scores completions as
TRL does (chat template over prompt + completion, right padding, ``logits[:, 0]``), for held-out measures.
"""

from __future__ import annotations

import pathlib

_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


class RewardModelError(ValueError):
    """A reward model path that cannot be used; the message (one line) names it."""


def _fail(path, why: str) -> RewardModelError:
    return RewardModelError(f"reward_model {str(path)!r}: {why}")


def _tokenizer(path: pathlib.Path):
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:
        raise _fail(path, f"its tokenizer does not load: {type(exc).__name__}: {str(exc).splitlines()[0]}") from None
    if not getattr(tokenizer, "chat_template", None):
        raise _fail(path, "its tokenizer has no chat template (the RL prompts are conversations, scored as "
                          "prompt + completion through the reward model's template)")
    return tokenizer


def check_reward_model(path: str | pathlib.Path):
    """The reward model's tokenizer, once the directory is a local one-label sequence-classification checkpoint
    with weights and a chat-template tokenizer; else RewardModelError. Loads no weights."""
    from transformers import AutoConfig

    where = pathlib.Path(path).expanduser()
    if not where.is_dir():
        raise _fail(path, "not a local directory (a reward model loads from a local path only; nothing is "
                          "downloaded)")
    try:
        config = AutoConfig.from_pretrained(where, local_files_only=True)
    except Exception as exc:
        raise _fail(path, f"no readable config.json: {type(exc).__name__}: {str(exc).splitlines()[0]}") from None
    kinds = list(getattr(config, "architectures", None) or [])
    if not any(k.endswith("ForSequenceClassification") for k in kinds):
        raise _fail(path, f"is a {'/'.join(kinds) or 'model without architectures'} checkpoint, not a reward model "
                          "(TRL needs a *ForSequenceClassification model with one label)")
    if config.num_labels != 1:
        raise _fail(path, f"has {config.num_labels} labels; a reward model has one (TRL reads logits[:, 0])")
    if not any((where / name).is_file() for name in _WEIGHTS):
        raise _fail(path, f"holds no weights ({', '.join(_WEIGHTS)})")
    return _tokenizer(where)


class RewardModel:
    """A checked reward model, loaded; ``__call__`` has TRL's reward-function signature."""

    __name__ = "reward_model"

    def __init__(self, path: str | pathlib.Path):
        from transformers import AutoModelForSequenceClassification

        self.tokenizer = check_reward_model(path)
        if self.tokenizer.pad_token_id is None:  # as TRL does: the score is read at the last non-pad token
            self.tokenizer.pad_token = self.tokenizer.eos_token
        try:
            self.model = AutoModelForSequenceClassification.from_pretrained(
                pathlib.Path(path).expanduser(), num_labels=1, local_files_only=True)
        except Exception as exc:
            raise _fail(path, f"does not load: {type(exc).__name__}: {str(exc).splitlines()[0]}") from None
        self.model.config.get_text_config().pad_token_id = self.tokenizer.pad_token_id
        self.model.eval().requires_grad_(False)
        self.architecture = type(self.model).__name__

    def __call__(self, prompts, completions, **_) -> list[float]:
        import torch
        from trl.data_utils import apply_chat_template

        texts = [apply_chat_template({"messages": p + c}, self.tokenizer)["text"] for p, c in zip(prompts, completions)]
        enc = self.tokenizer(text=texts, return_tensors="pt", padding=True, padding_side="right",
                             add_special_tokens=False).to(next(self.model.parameters()).device)
        with torch.inference_mode():
            return self.model(**enc).logits[:, 0].float().tolist()
