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
    """gym_train.Evaluator on one base checkpoint, plus the loss of any other checkpoint directory."""

    def __init__(self, base_dir: Path, examples: list[dict]) -> None:
        from zoo_gym.gym_train import Evaluator

        self.examples = examples
        self.base = Evaluator(base_dir, examples)

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
