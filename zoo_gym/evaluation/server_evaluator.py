"""The server's evaluator of one base checkpoint: held-out loss, scoring set and scoring gradient, streamed.

`ServerEvaluator` reads the checkpoint one decoder layer at a time (streamed_model.py). Its scoring set (the
first `scoring_examples` validation examples) is packed with its shared chat prefix computed once (packing.py)
or, with preference pairs in the validation data (`chosen`/`rejected`), scored on their Bradley-Terry loss
(preference_scoring.py); the held-out loss then runs on the other records (on the pairs' chosen answers when
there are none). `heldout_loss()` takes the scoring set's part of the loss from the scoring gradient's forward.
With ``metric="exact-match"`` rewards are scored on the scoring set's 0-1 loss (`score_loss`: greedy exact match).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch

from zoo_gym.io.safetensors_reader import WeightsFile

from .memory import release_memory
from .preference_eval import is_pair
from .scoring_metrics import SCORING_METRICS
from .streamed_model import computing


class ServerEvaluator:
    """`evaluate.Evaluator` on one base checkpoint, plus the loss of any other checkpoint directory.

    Rewards scoring uses a smaller fixed scoring set (the first `scoring_examples` validation
    examples): `scoring.loss(delta, scale=c)` for exact losses and `gradient()` for the base's
    gradient (computed once per base). Both run on the scoring set packed with its shared chat
    prefix computed once (zoo_gym.evaluation.packing: same loss, fewer positions than padded
    batches); a model whose attention cannot take the packing mask falls back to padded batches.
    ``dtype`` (torch.float32 or torch.bfloat16) is what the held-out passes and the gradient multiply in;
    base + delta (`scoring.loss(delta)`, `solo_loss`) always computes in float32. ``metric`` is what rewards
    are scored on (`score_loss`): "loss", the completion loss, or "exact-match", the 0-1 loss of greedy answers.
    """

    def __init__(self, base_dir: Path, examples: list[dict], *, scoring_examples: int = 32,
                 spill_dir: Path | None = None, weights: WeightsFile | None = None,
                 dtype: torch.dtype | None = None, metric: str = "loss", heldout_from_gradient: bool = True) -> None:
        from .evaluate import Evaluator, tokenize_examples
        from .packing import PackedScoringSet, supports_packing
        from .streamed_model import load_streamed

        self.examples = examples
        self.pairs, self.loss_examples = loss_and_pairs(examples)
        # the scoring gradient goes to a file here as the backward produces it (evaluation/spill.py): never
        # resident, from the publish that computes it to the round that reads it
        self.spill_dir = Path(spill_dir) if spill_dir is not None else Path(tempfile.gettempdir())
        # one decoder layer's weights at a time, read from the checkpoint (evaluation/streamed_model.py): from
        # `weights` when given (a checkpoint archive's, in place), else base_dir's model.safetensors
        self.base = Evaluator(base_dir, self.loss_examples, model=load_streamed(base_dir, weights))
        self.scoring_set = (self.pairs or examples)[:scoring_examples]
        tok, model = self.base.tokenizer, self.base.model
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        tokenized = [] if self.pairs else tokenize_examples(tok, self.scoring_set)
        self._preference = None
        if self.pairs:  # scored on the pairs' preference loss (evaluation/preference_scoring.py)
            from .preference_scoring import PreferenceScoringSet

            self.scoring = PreferenceScoringSet(model, tok, self.scoring_set)
        elif supports_packing(model):
            self.scoring = PackedScoringSet(model, tokenized, pad_id=pad)
        else:
            self.scoring = Evaluator(None, self.scoring_set, model=model, tokenizer=tok)
        self.metric = metric
        check_metric(metric, pairs=bool(self.pairs), packed=isinstance(self.scoring, PackedScoringSet))
        # exact match: each reference through its first end-of-turn token, where greedy decoding stops
        self.zero_one = None if metric != "exact-match" else PackedScoringSet(
            model, [(p, through_first(c, tok.eos_token_id)) for p, c in tokenized], pad_id=pad)
        # False when nothing of the round needs the gradient (exact scoring, a rule without a reference): the
        # held-out loss is then measured without it rather than computing a backward for its forward's loss
        self.heldout_from_gradient = heldout_from_gradient
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
        self._gradient = self.base = self.scoring = self.zero_one = None
        self.released = True

    def gradient(self):
        """`gradient.BaseGradient` of the base's loss on the scoring set (cached)."""
        if self._gradient is None:
            from .gradient import base_gradient

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
            if self._gradient is not None or self.pairs or not self.heldout_from_gradient:  # measured once
                return self.heldout_loss()
            with computing(self.base.model, self.dtype):
                total, count = _loss_sum(self.base.model, self.base.tokenizer, self.loss_examples)
            return total / max(count, 1)
        return self.base.loss(delta, scale=scale)

    def score_loss(self, delta=None, *, scale: float = 1.0) -> float:
        """The loss exact rewards scoring compares (base + ``scale * delta``, float32): the scoring set's mean
        completion loss, or with metric "exact-match" its 0-1 loss, the share of its references that greedy
        decoding does not write (a verifiable task's accuracy, which the completion loss can rank otherwise)."""
        if self.zero_one is not None:
            return self.zero_one.zero_one_loss(delta, scale=scale)
        return self.scoring.loss(delta, scale=scale)

    def score_losses(self, delta=None, *, scale: float = 1.0) -> torch.Tensor | None:
        """`score_loss` per scoring example, (examples,) float: each one's 0-1 loss with metric "exact-match"; None
        for the completion loss, whose mean weighs examples by their tokens (rewards then measure no error)."""
        if self.zero_one is None:
            return None
        return self.zero_one.misses(delta, scale=scale).float()

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
        of another loss, and with `heldout_from_gradient` False none is read: then the held-out loss is measured
        on `loss_examples` alone (no gradient). Measured once.
        """
        if self._heldout is None and (self.pairs or (self._gradient is None and not self.heldout_from_gradient)):
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
            from .preference_eval import PreferenceEvaluator

            self._preference = PreferenceEvaluator(None, self.pairs, model=self.base.model,
                                                   tokenizer=self.base.tokenizer).report()
        return self._preference


def check_metric(metric: str, *, pairs: bool, packed: bool) -> None:
    """Refuse a scoring metric this validation set or model cannot give, saying what to change."""
    if metric not in SCORING_METRICS:
        raise ValueError(f"the scoring metric must be one of {list(SCORING_METRICS)}, got {metric!r}")
    if metric == "exact-match" and pairs:
        raise ValueError("scoring by exact match needs SFT records with reference answers; this validation set "
                         "is preference pairs: use --scoring-metric loss")
    if metric == "exact-match" and not packed:
        raise ValueError("scoring by exact match needs a model whose attention takes a 4D mask (sdpa or eager): "
                         "use --scoring-metric loss")


def through_first(ids: list[int], token: int | None) -> list[int]:
    """``ids`` up to and including the first ``token`` (all of them when it is absent or None)."""
    return ids[:ids.index(token) + 1] if token is not None and token in ids else ids


def loss_and_pairs(examples: list[dict]) -> tuple[list[dict], list[dict]]:
    """(preference pairs, the examples the held-out loss runs on): the records that are not pairs, or, when
    every record is a pair, the pairs with their chosen answer as the output."""
    pairs = [ex for ex in examples if is_pair(ex)]
    rest = [ex for ex in examples if not is_pair(ex)]
    if pairs and not rest:
        rest = [{**{k: v for k, v in ex.items() if k not in ("chosen", "rejected")}, "output": ex["chosen"]}
                for ex in pairs]
    return pairs, rest


def _loss_sum(model, tokenizer, examples: list[dict]) -> tuple[float, int]:
    """(summed completion cross-entropy, completion tokens) without gradients."""
    import torch

    from .evaluate import collate, completion_loss_sum, tokenize_examples
    from .packing import PackedScoringSet, supports_packing

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    pairs = tokenize_examples(tokenizer, examples)
    if supports_packing(model):
        ps = PackedScoringSet(model, pairs, pad_id=pad)
        return ps.loss(None) * ps.batch.tokens, ps.batch.tokens
    pairs.sort(key=lambda pc: len(pc[0]) + len(pc[1]))
    with torch.inference_mode():
        return completion_loss_sum(model, [collate(pairs[i:i + 64], pad_id=pad)
                                           for i in range(0, len(pairs), 64)])
