"""The round manager's evaluators: one `zoo_gym.evaluation.ServerEvaluator` per base, kept from round to round.

One pass per published base serves both the held-out loss and rewards scoring: `Evaluators.measure_published`
builds the next round's evaluator, whose `heldout_loss()` takes the scoring set's part of the loss from the
forward pass of the scoring gradient (scoring then costs only its backward; with exact scoring and a rule that
weighs by no reference direction nothing reads a gradient, and none is computed); `Evaluators.for_base` hands it
to the next round (recognised by its weights' sha256). The first base after a start has no such pass: the round
manager runs it (`Evaluators.prepare`) while that round waits for submissions. The validation set is read by
`server/genesis.py` (the server's one door to gym_train's data formats); the evaluation is zoo_gym.evaluation's.
"""

from __future__ import annotations

from pathlib import Path

from zoo_gym.evaluation.server_evaluator import ServerEvaluator
from zoo_gym.evaluation.streamed_model import compute_dtype
from zoo_gym.io.safetensors_reader import WeightsFile
from zoo_gym.server.config import ServerConfig
from zoo_gym.server.genesis import validation_examples
from zoo_gym.server.store.state import ServerState


class Evaluators:
    """The evaluators of the bases one round manager scores: the current base's (one model in memory), and the
    one built when the next base was published, whose held-out pass computed that base's scoring gradient
    (handed back when its round is scored: no second model load, no second forward over the scoring set)."""

    def __init__(self, state: ServerState, config: ServerConfig) -> None:
        self.state, self.config = state, config
        self.dtype = compute_dtype(config.evaluation_dtype)
        # the base's gradient is read only by first-order scoring and a rule that weighs by the descent direction:
        # otherwise no backward is run for it (the held-out loss is measured without one)
        self.needs_gradient = config.rewards.scoring_method == "first-order" or config.soup.rule.needs_reference
        self._current: dict[str, ServerEvaluator] = {}
        self._prepared: dict[str, ServerEvaluator] = {}  # weights sha256 -> evaluator built when it was published

    def for_base(self, base_sha256: str) -> ServerEvaluator | None:
        """The evaluator of a base checkpoint (None when `validation_examples` is 0: no held-out loss and no
        scoring)."""
        if self.config.validation_examples <= 0:
            return None
        if base_sha256 not in self._current:
            self._current.clear()  # one base at a time: a model in memory is enough
            examples = list(validation_examples(self.config.validation_data, self.config.validation_examples))
            base_dir, weights = self.state.checkpoint_files(base_sha256)
            ready = self._prepared.pop(base_sha256, None)
            if ready is None and self._prepared:
                ready = self._prepared.pop(weights.sha256(), None)
            self._prepared.clear()
            if ready is not None and ready.examples == examples:
                self._current[base_sha256] = ready  # its scoring gradient came with the held-out loss
            else:
                self._current[base_sha256] = ServerEvaluator(
                    base_dir, examples, spill_dir=self.state.work_dir, weights=weights, dtype=self.dtype,
                    scoring_examples=self.config.rewards.scoring_examples, metric=self.config.rewards.scoring_metric,
                    heldout_from_gradient=self.needs_gradient)
        return self._current[base_sha256]

    def prepare(self, base_sha256: str, *, heldout: bool) -> list[str]:
        """The base's evaluator and scoring gradient now, and its held-out loss when `heldout` (a base whose loss
        is not recorded yet): what the round's publish would compute first. The round manager calls it while
        the round waits for submissions. What it computed, by name (empty: all ready, or no evaluator)."""
        known = [self._current.get(base_sha256), *self._prepared.values()]  # built before: not built now
        evaluator = self.for_base(base_sha256)
        if evaluator is None or evaluator.released:
            return []
        done = [] if any(evaluator is k for k in known) else ["evaluator"]
        if self.needs_gradient and not evaluator.has_gradient:
            evaluator.gradient()
            done.append("scoring gradient")
        if heldout and not evaluator.has_heldout:
            evaluator.heldout_loss()
            done.append("held-out loss")
        return done

    def measure_published(self, evaluator: ServerEvaluator, model_dir: Path, *, weights: WeightsFile | None = None,
                          checkpoint_sha256: str | None = None) -> float:
        """Held-out loss of a newly published checkpoint (`model_dir`; its weights there or at `weights`),
        measured by the evaluator of the round it starts (kept for `for_base`, recognised by
        `checkpoint_sha256`, else by its weights' sha256). Call `evaluator.release()` first to hold one
        model at a time."""
        from zoo_gym.proto import archive

        self._current.clear()  # this base is superseded
        self._prepared.clear()  # one prepared base at a time
        weights = weights or WeightsFile(Path(model_dir) / archive.WEIGHTS)
        nxt = ServerEvaluator(Path(model_dir), evaluator.examples, scoring_examples=len(evaluator.scoring_set),
                              spill_dir=evaluator.spill_dir, weights=weights, dtype=self.dtype,
                              metric=evaluator.metric, heldout_from_gradient=self.needs_gradient)
        loss = nxt.heldout_loss()
        nxt.preference_report()  # with pairs: measured now, the next round's "before" then costs nothing
        self._prepared[checkpoint_sha256 or weights.sha256()] = nxt
        return loss

    def published_preference(self, checkpoint_sha256: str) -> dict | None:
        """The preference report `measure_published` took of that checkpoint (None without pairs)."""
        ready = self._prepared.get(checkpoint_sha256)
        return ready.preference_report() if ready is not None else None

    def forget(self, evaluator: ServerEvaluator | None) -> None:
        """Drop a released `evaluator` (the next `for_base` of its base builds a fresh one)."""
        if evaluator is None or not evaluator.released:
            return
        for cache in (self._current, self._prepared):
            for k in [k for k, v in cache.items() if v is evaluator]:
                del cache[k]
