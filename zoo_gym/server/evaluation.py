"""Held-out evaluation on the server's validation set (built-in for the tiny model, a file otherwise)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from zoo_gym.server.config import ServerConfig
from zoo_gym.server.state import ServerState


@lru_cache(maxsize=4)
def _validation_examples(validation_file: str | None, n: int) -> tuple:
    from zoo_gym import gym_train

    if validation_file:
        return tuple(gym_train.load_examples(Path(validation_file))[:n])
    return tuple(gym_train.default_validation_examples(n=n))


class ServerEvaluator:
    """gym_train.Evaluator on one base checkpoint, plus the loss of any other checkpoint directory.

    Rewards scoring uses a smaller fixed scoring set (the first `scoring_examples` validation
    examples): `scoring.loss(delta, scale=c)` for exact losses and `gradient()` for the base's
    gradient (computed once per base). Both run on the scoring set packed with its shared chat
    prefix computed once (zoo_gym.rewards.packing: same loss, ~0.6x the positions of padded
    batches); a model whose attention cannot take the packing mask falls back to padded batches.
    """

    def __init__(self, base_dir: Path, examples: list[dict], *, scoring_examples: int = 32) -> None:
        from zoo_gym.gym_train import Evaluator
        from zoo_gym.gym_train.evaluate import tokenize_examples
        from zoo_gym.rewards.packing import PackedScoringSet, supports_packing

        self.examples = examples
        self.base = Evaluator(base_dir, examples)
        self.scoring_set = examples[:scoring_examples]
        tok, model = self.base.tokenizer, self.base.model
        if supports_packing(model):
            pad = tok.pad_token_id if tok.pad_token_id is not None else 0
            self.scoring = PackedScoringSet(model, tokenize_examples(tok, self.scoring_set), pad_id=pad)
        else:
            self.scoring = Evaluator(None, self.scoring_set, model=model, tokenizer=tok)
        self._gradient = None

    def gradient(self):
        """zoo_gym.rewards.BaseGradient of the base's loss on the scoring set (cached)."""
        if self._gradient is None:
            from zoo_gym.rewards import base_gradient

            if hasattr(self.scoring, "gradient"):
                self._gradient = self.scoring.gradient()
            else:  # padded fallback: the Evaluator's own length-sorted batches
                self._gradient = base_gradient(self.base.model, self.scoring._batches)  # noqa: SLF001
        return self._gradient

    def loss(self, delta=None, *, scale: float = 1.0) -> float:
        return self.base.loss(delta, scale=scale)

    def loss_of_dir(self, model_dir: Path) -> float:
        from zoo_gym.gym_train import heldout_loss

        return float(heldout_loss(model_dir, self.examples))


_cache: dict[str, ServerEvaluator] = {}


def evaluator_for(state: ServerState, config: ServerConfig, base_sha256: str) -> ServerEvaluator:
    key = f"{state.root}:{base_sha256}"
    if key not in _cache:
        _cache.clear()  # one base at a time: a model in memory is enough
        examples = list(_validation_examples(config.validation_file, config.validation_examples))
        _cache[key] = ServerEvaluator(state.checkpoint_dir(base_sha256), examples)
    return _cache[key]
