"""Held-out evaluation on the server's validation set (built-in for the tiny model, a file otherwise).

One pass per published base serves both the held-out loss and rewards scoring: `Evaluators.measure_published`
builds the next round's `ServerEvaluator`, whose `heldout_loss()` takes the scoring set's part of the loss from
the forward pass of the scoring gradient (scoring then costs only its backward); `Evaluators.for_base` hands it
to the next round (recognised by its weights' sha256). The first base after a start has no such pass: the round
manager runs it (`Evaluators.prepare`) while that round waits for submissions.
Preference pairs in the validation data (`chosen`/`rejected`) add a preference report (accuracy, mean margin)
and become the scoring set, scored on their Bradley-Terry loss (rewards/preference.py); the held-out loss then
runs on the other records (on the pairs' chosen answers when there are none).
"""

from __future__ import annotations

import tempfile
from functools import lru_cache
from pathlib import Path

import torch

from zoo_gym.rewards.streamed_model import computing, compute_dtype
from zoo_gym.server.config import ServerConfig
from zoo_gym.gym_train.memory import release_memory
from zoo_gym.safetensors_reader import WeightsFile
from zoo_gym.server.store.state import ServerState


@lru_cache(maxsize=4)
def _validation_examples(validation_file: str | None, n: int) -> tuple:
    from zoo_gym import gym_train

    if validation_file:
        return tuple(load_validation(Path(validation_file))[:n])
    return tuple(gym_train.default_validation_examples(n=n))


def load_validation(path: Path) -> list[dict]:
    """The validation file's records, normalised as `gym_train.load_examples` does, plus preference pairs:
    a record with `chosen` and `rejected` strings beside alpaca (`instruction`/`input`) or `prompt` fields
    becomes the normalised prompt fields with `chosen` and `rejected` (no `output`)."""
    from zoo_gym.gym_train.errors import DataError
    from zoo_gym.gym_train.formats import normalise_record
    from zoo_gym.gym_train.sources import iter_records

    out = []
    for where, rec in iter_records(path):
        if isinstance(rec, dict) and rec.get("chosen") is not None and rec.get("rejected") is not None:
            answers = {k: rec[k] for k in ("chosen", "rejected")}
            for k, v in answers.items():
                if not isinstance(v, str) or not v.strip():
                    raise DataError(str(path), where, k, "must be a non-empty string (a preference pair's answer)")
            prompt = {k: v for k, v in rec.items() if k not in ("chosen", "rejected", "output", "completion")}
            ex = normalise_record({**prompt, "completion" if "prompt" in prompt else "output": answers["chosen"]},
                                  file=str(path), where=where)
            ex.pop("output", None)
            out.append({**ex, **answers})
        else:
            out.append(normalise_record(rec, file=str(path), where=where))
    if not out:
        raise DataError(str(path), "line 1", "<file>", "holds no records")
    return out


class ServerEvaluator:
    """gym_train.Evaluator on one base checkpoint, plus the loss of any other checkpoint directory.

    Rewards scoring uses a smaller fixed scoring set (the first `scoring_examples` validation
    examples): `scoring.loss(delta, scale=c)` for exact losses and `gradient()` for the base's
    gradient (computed once per base). Both run on the scoring set packed with its shared chat
    prefix computed once (zoo_gym.rewards.packing: same loss, fewer positions than padded
    batches); a model whose attention cannot take the packing mask falls back to padded batches.
    ``dtype`` (torch.float32 or torch.bfloat16) is what the held-out passes and the gradient multiply in;
    base + delta (`scoring.loss(delta)`, `solo_loss`) always computes in float32.
    """

    def __init__(self, base_dir: Path, examples: list[dict], *, scoring_examples: int = 32,
                 spill_dir: Path | None = None, weights: WeightsFile | None = None,
                 dtype: torch.dtype | None = None) -> None:
        from zoo_gym.gym_train import Evaluator
        from zoo_gym.gym_train.evaluate import tokenize_examples
        from zoo_gym.rewards.packing import PackedScoringSet, supports_packing
        from zoo_gym.rewards.streamed_model import load_streamed

        self.examples = examples
        self.pairs, self.loss_examples = loss_and_pairs(examples)
        # the scoring gradient goes to a file here as the backward produces it (rewards/spill.py): never
        # resident, from the publish that computes it to the round that reads it
        self.spill_dir = Path(spill_dir) if spill_dir is not None else Path(tempfile.gettempdir())
        # one decoder layer's weights at a time, read from the checkpoint (rewards/streamed_model.py): from
        # `weights` when given (a checkpoint archive's, in place), else base_dir's model.safetensors
        self.base = Evaluator(base_dir, self.loss_examples, model=load_streamed(base_dir, weights))
        self.scoring_set = (self.pairs or examples)[:scoring_examples]
        tok, model = self.base.tokenizer, self.base.model
        self._preference = None
        if self.pairs:  # scored on the pairs' preference loss (rewards/preference.py)
            from zoo_gym.rewards.preference import PreferenceScoringSet

            self.scoring = PreferenceScoringSet(model, tok, self.scoring_set)
        elif supports_packing(model):
            pad = tok.pad_token_id if tok.pad_token_id is not None else 0
            self.scoring = PackedScoringSet(model, tokenize_examples(tok, self.scoring_set), pad_id=pad)
        else:
            self.scoring = Evaluator(None, self.scoring_set, model=model, tokenizer=tok)
        self._gradient = None
        self._float32_base_loss: float | None = None
        self._heldout: float | None = None  # heldout_loss(), measured once: a base's never changes
        self.dtype = dtype if dtype is not None else torch.float32
        self.released = False

    @property
    def has_gradient(self) -> bool:
        """Whether `gradient()` was computed (its tensors may be released since; the loss and norm stay)."""
        return self._gradient is not None

    @property
    def has_heldout(self) -> bool:
        """Whether `heldout_loss()` was measured (it is kept)."""
        return self._heldout is not None

    def release_gradient(self) -> None:
        """Free the gradient's tensors once the round's slopes are taken; its loss, norm and size stay
        (first-order scoring needs only those). Until `forget`, `gradient()` returns that summary."""
        if self._gradient is not None:
            self._gradient = self._gradient.release()
            self.released = True

    def release(self) -> None:
        """Drop the model (and gradient): this evaluator is done; the server keeps one model in memory."""
        self._gradient = self.base = self.scoring = None
        self.released = True

    def gradient(self):
        """zoo_gym.rewards.BaseGradient of the base's loss on the scoring set (cached)."""
        if self._gradient is None:
            from zoo_gym.rewards import base_gradient

            with computing(self.base.model, self.dtype):
                if hasattr(self.scoring, "gradient"):
                    self._gradient = self.scoring.gradient(spill_dir=self.spill_dir)
                else:  # padded fallback: the Evaluator's own length-sorted batches
                    self._gradient = base_gradient(self.base.model, self.scoring._batches,  # noqa: SLF001
                                                   spill_dir=self.spill_dir)
            release_memory()  # the backward's activations and buffers, kept by malloc otherwise
        return self._gradient

    def loss(self, delta=None, *, scale: float = 1.0) -> float:
        """Mean completion loss on all validation examples of the base (+ ``scale * delta``).

        Without a delta it is `heldout_loss` (the same definition as every published checkpoint's):
        taken from the scoring gradient's forward when that was computed, else measured packed
        without gradients (no logits over the vocabulary at unscored positions)."""
        if delta is None:
            if self._gradient is not None or self.pairs:  # with pairs: measured once, on `loss_examples`
                return self.heldout_loss()
            with computing(self.base.model, self.dtype):
                total, count = _loss_sum(self.base.model, self.base.tokenizer, self.loss_examples)
            return total / max(count, 1)
        return self.base.loss(delta, scale=scale)

    def solo_loss(self, delta, *, scale: float = 1.0) -> float:
        """Scoring loss of base + ``scale * delta`` (float32), on the level of ``gradient().base_loss``.

        The first-order check compares it with the gradient's base loss. A gradient taken in bf16 has that
        loss a bf16 rounding away from float32's, which can exceed a small delta's whole effect: then the
        delta's float32 change (against the float32 base loss, measured once) is added to the gradient's."""
        loss = self.scoring.loss(delta, scale=scale)
        if self.dtype is torch.float32:
            return loss
        if self._float32_base_loss is None:
            self._float32_base_loss = self.scoring.loss(None)
        return self.gradient().base_loss + (loss - self._float32_base_loss)

    def heldout_loss(self) -> float:
        """Mean completion loss of this base on all validation examples, token-weighted.

        The scoring set's part comes from the forward pass of `gradient()` (computed and cached
        here: the held-out loss needs that forward anyway, so scoring adds only the backward);
        the other examples are evaluated without gradients. With preference pairs the scoring gradient is
        of another loss: the held-out loss is measured on `loss_examples` alone (no gradient). Measured once.
        """
        if self.pairs and self._heldout is None:
            with computing(self.base.model, self.dtype):
                total, count = _loss_sum(self.base.model, self.base.tokenizer, self.loss_examples)
            self._heldout = total / max(count, 1)
        if self._heldout is None:
            g = self.gradient()
            total, count = g.base_loss * g.tokens, g.tokens
            rest = self.examples[len(self.scoring_set):]
            if rest:
                with computing(self.base.model, self.dtype):
                    t, c = _loss_sum(self.base.model, self.base.tokenizer, rest)
                total, count = total + t, count + c
            self._heldout = total / max(count, 1)
        return self._heldout

    def preference_report(self) -> dict | None:
        """Preference accuracy, mean margin and pair count of this base on all validation pairs (None without
        pairs; measured once)."""
        if self.pairs and self._preference is None:
            from zoo_gym.gym_train.preference_eval import PreferenceEvaluator

            self._preference = PreferenceEvaluator(None, self.pairs, model=self.base.model,
                                                   tokenizer=self.base.tokenizer).report()
        return self._preference


def loss_and_pairs(examples: list[dict]) -> tuple[list[dict], list[dict]]:
    """(preference pairs, the examples the held-out loss runs on): the records that are not pairs, or, when
    every record is a pair, the pairs with their chosen answer as the output."""
    from zoo_gym.gym_train.preference_eval import is_pair

    pairs = [ex for ex in examples if is_pair(ex)]
    rest = [ex for ex in examples if not is_pair(ex)]
    if pairs and not rest:
        rest = [{**{k: v for k, v in ex.items() if k not in ("chosen", "rejected")}, "output": ex["chosen"]}
                for ex in pairs]
    return pairs, rest


def _loss_sum(model, tokenizer, examples: list[dict]) -> tuple[float, int]:
    """(summed completion cross-entropy, completion tokens) without gradients."""
    import torch

    from zoo_gym.gym_train.evaluate import collate, completion_loss_sum, tokenize_examples
    from zoo_gym.rewards.packing import PackedScoringSet, supports_packing

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    pairs = tokenize_examples(tokenizer, examples)
    if supports_packing(model):
        ps = PackedScoringSet(model, pairs, pad_id=pad)
        return ps.loss(None) * ps.batch.tokens, ps.batch.tokens
    pairs.sort(key=lambda pc: len(pc[0]) + len(pc[1]))
    with torch.inference_mode():
        return completion_loss_sum(model, [collate(pairs[i:i + 64], pad_id=pad)
                                           for i in range(0, len(pairs), 64)])


def _weights_digest(weights: WeightsFile) -> str:
    """sha256 of a checkpoint's weights bytes: recognises a published base after its archive round trip."""
    import hashlib

    h = hashlib.sha256()
    with open(weights.path, "rb") as f:
        f.seek(weights.offset)
        left = weights.length if weights.length is not None else float("inf")
        while left > 0 and (chunk := f.read(int(min(1 << 20, left)))):
            h.update(chunk)
            left -= len(chunk)
    return h.hexdigest()


class Evaluators:
    """The evaluators of the bases one round manager scores: the current base's (one model in memory), and the
    one built when the next base was published, whose held-out pass computed that base's scoring gradient
    (handed back when its round is scored: no second model load, no second forward over the scoring set)."""

    def __init__(self, state: ServerState, config: ServerConfig) -> None:
        self.state, self.config = state, config
        self.dtype = compute_dtype(config.evaluation_dtype)
        self._current: dict[str, ServerEvaluator] = {}
        self._prepared: dict[str, ServerEvaluator] = {}  # weights sha256 -> evaluator built when it was published

    def for_base(self, base_sha256: str) -> ServerEvaluator | None:
        """The evaluator of a base checkpoint (None when `validation_examples` is 0: no held-out loss and no
        scoring)."""
        if self.config.validation_examples <= 0:
            return None
        if base_sha256 not in self._current:
            self._current.clear()  # one base at a time: a model in memory is enough
            examples = list(_validation_examples(self.config.validation_data, self.config.validation_examples))
            base_dir, weights = self.state.checkpoint_files(base_sha256)
            ready = self._prepared.pop(base_sha256, None)
            if ready is None and self._prepared:
                ready = self._prepared.pop(_weights_digest(weights), None)
            self._prepared.clear()
            if ready is not None and ready.examples == examples:
                self._current[base_sha256] = ready  # its scoring gradient came with the held-out loss
            else:
                self._current[base_sha256] = ServerEvaluator(base_dir, examples, spill_dir=self.state.work_dir,
                                                             weights=weights, dtype=self.dtype)
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
        if not evaluator.has_gradient:
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
                              spill_dir=evaluator.spill_dir, weights=weights, dtype=self.dtype)
        loss = nxt.heldout_loss()
        nxt.preference_report()  # with pairs: measured now, the next round's "before" then costs nothing
        self._prepared[checkpoint_sha256 or _weights_digest(weights)] = nxt
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
