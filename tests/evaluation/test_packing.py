"""Shared-prefix packing of the scoring set: the layout by hand, the loss and gradient equal the
padded reference on the tiny model (sdpa and eager), random example sets as a property, weights
restored, the errors, and SlopeTap.delta_of."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zoo_gym.aggregation import DeltaSoup, SoupConfig
from zoo_gym.aggregation.sources import DictDeltaSource
from zoo_gym.gym_train import Evaluator, default_validation_examples, tiny_model_dir
from zoo_gym.evaluation.evaluate import collate, completion_loss_sum, tokenize_examples
from zoo_gym.evaluation import EvaluationInputError, base_gradient
from zoo_gym.rewards import ScoringInputError, SlopeTap
from zoo_gym.evaluation.packed_batch import pack_shared_prefix, supports_packing
from zoo_gym.evaluation.packing import PackedScoringSet


@pytest.fixture(scope="module")
def tiny():
    ev = Evaluator(tiny_model_dir(), default_validation_examples(n=32))
    return ev


def test_layout_hand_checked():
    # Prepare: three examples sharing the token 1; the third's prompt is [1, 2], so its first
    # scored position is 1 and the shared prefix stops at length 1 (not 2).
    pairs = [([1, 2, 3], [4, 5]), ([1, 2, 6], [7]), ([1, 2], [8, 9])]
    # Execute
    b = pack_shared_prefix(pairs, pad_id=0, row_tokens=100)
    # Assert: one row [1 | 2 3 4 | 2 6 | 2 8]: the prefix once, each example's last token (only a
    # target) left out, positions restart after the prefix
    assert b.prefix == 1 and b.examples == 3 and b.tokens == 5
    assert b.input_ids.tolist() == [[1, 2, 3, 4, 2, 6, 2, 8]]
    assert b.position_ids.tolist() == [[0, 1, 2, 3, 1, 2, 1, 2]]
    assert b.predict_at.tolist() == [2, 3, 5, 6, 7] and b.targets.tolist() == [4, 5, 7, 8, 9]
    allowed = b.allowed[0, 0]
    assert torch.nonzero(allowed[5]).flatten().tolist() == [0, 4, 5]   # prefix + own suffix
    assert torch.nonzero(allowed[7]).flatten().tolist() == [0, 6, 7]
    assert torch.nonzero(allowed[3]).flatten().tolist() == [0, 1, 2, 3]


def test_rows_balanced_longest_first_and_pads_see_only_themselves():
    pairs = [([5, 6], [7] * k) for k in (6, 1, 4, 3, 3)]  # suffixes (last token dropped): k
    b = pack_shared_prefix(pairs, pad_id=0, row_tokens=12)
    # P = 1 (first scored position is 1); 17 suffix tokens / 11 per row -> 2 rows;
    # LPT: 6 -> r0, 4 -> r1, 3 -> r1, 3 -> r0, 1 -> r1: fills 9 and 8, T = 1 + 9
    assert b.prefix == 1 and tuple(b.input_ids.shape) == (2, 10)
    assert b.input_ids[1, 9].item() == 0 and b.input_ids[0, 9].item() != 0  # one pad, in row 1
    assert torch.nonzero(b.allowed[1, 0, 9]).flatten().tolist() == [9]
    assert b.tokens == 6 + 1 + 4 + 3 + 3


def _padded_loss(model, pairs) -> float:
    with torch.inference_mode():
        total, count = completion_loss_sum(model, [collate(list(pairs), pad_id=0)])
    return total / count


def test_loss_and_gradient_equal_the_padded_reference(tiny):
    pairs = tokenize_examples(tiny.tokenizer, default_validation_examples(n=32))
    ps = PackedScoringSet(tiny.model, pairs, pad_id=0)
    assert ps.batch.prefix >= 4  # the chat template is shared: the packing has something to share
    assert ps.batch.input_ids.numel() < collate(pairs, pad_id=0)[0].numel() * 0.7
    assert ps.loss(None) == pytest.approx(tiny.loss(None), rel=1e-6)
    gen = torch.Generator().manual_seed(0)
    delta = {k: torch.randn(p.shape, generator=gen) * 1e-2 for k, p in tiny.model.named_parameters()}
    before = {k: p.detach().clone() for k, p in tiny.model.named_parameters()}
    want = tiny.loss(delta, scale=0.5)
    assert want != pytest.approx(tiny.loss(None), rel=1e-4)  # the delta changes the loss
    assert ps.loss(delta, scale=0.5) == pytest.approx(want, rel=1e-6)
    assert all(torch.equal(p, before[k]) for k, p in tiny.model.named_parameters())  # restored
    g = ps.gradient()
    ref = base_gradient(tiny.model, tiny._batches)  # noqa: SLF001 (the evaluator's padded batches)
    assert g.base_loss == pytest.approx(ref.base_loss, rel=1e-6) and g.tokens == ref.tokens
    assert g.examples == 32
    for k, v in ref.grad.items():
        assert float((g.grad[k] - v).norm()) <= 1e-4 * float(v.norm()) + 1e-9, k
    assert all(p.grad is None for p in tiny.model.parameters())


def test_eager_attention_takes_the_additive_mask(tiny):
    pairs = tokenize_examples(tiny.tokenizer, default_validation_examples(n=8))
    model = tiny.model
    sdpa = PackedScoringSet(model, pairs, pad_id=0).loss(None)
    model.set_attn_implementation("eager")
    try:
        assert supports_packing(model)
        eager = PackedScoringSet(model, pairs, pad_id=0).loss(None)
    finally:
        model.set_attn_implementation("sdpa")
    assert eager == pytest.approx(sdpa, rel=1e-5)
    assert eager == pytest.approx(_padded_loss(model, pairs), rel=1e-5)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(prefix=st.lists(st.integers(3, 300), min_size=0, max_size=6),
       examples=st.lists(st.tuples(st.lists(st.integers(3, 300), min_size=0, max_size=8),
                                   st.lists(st.integers(3, 300), min_size=1, max_size=6)),
                         min_size=1, max_size=7),
       row_tokens=st.integers(2, 60))
def test_packed_loss_equals_padded_loss_on_random_examples(tiny, prefix, examples, row_tokens):
    pairs = [(prefix + p, c) for p, c in examples]
    if all(len(p) + len(c) < 2 for p, c in pairs):
        with pytest.raises(EvaluationInputError, match="no example has a completion token"):
            pack_shared_prefix(pairs, pad_id=0, row_tokens=row_tokens)
        return
    ps = PackedScoringSet(tiny.model, pairs, pad_id=0, row_tokens=row_tokens)
    assert ps.loss(None) == pytest.approx(_padded_loss(tiny.model, pairs), rel=2e-5)


def test_errors_name_what_to_change(tiny):
    with pytest.raises(EvaluationInputError, match="`pairs` is empty"):
        pack_shared_prefix([], pad_id=0)
    with pytest.raises(EvaluationInputError, match="`row_tokens`"):
        pack_shared_prefix([([1], [2])], pad_id=0, row_tokens=1)
    with pytest.raises(EvaluationInputError, match="no example has a completion token"):
        pack_shared_prefix([([1, 2], [])], pad_id=0)
    ps = PackedScoringSet(tiny.model, [([1, 2, 3], [4, 5])], pad_id=0)
    with pytest.raises(EvaluationInputError, match="not a parameter"):
        ps.loss({"nope.weight": torch.zeros(3)})
    name = "model.norm.weight"
    with pytest.raises(EvaluationInputError, match="shape"):
        ps.loss({name: torch.zeros(3)})
    emb = tiny.model.get_input_embeddings().weight
    before = emb.detach().clone()
    with pytest.raises(EvaluationInputError, match="tied parameter"):
        ps.loss({"model.embed_tokens.weight": torch.ones_like(emb), "lm_head.weight": torch.ones_like(emb)})
    assert torch.equal(emb, before)  # restored after the refusal
    tiny.model.config._attn_implementation = "flash_attention_2"  # noqa: SLF001 (only the name)
    try:
        assert not supports_packing(tiny.model)
        with pytest.raises(EvaluationInputError, match="sdpa"):
            PackedScoringSet(tiny.model, [([1, 2, 3], [4, 5])], pad_id=0)
    finally:
        tiny.model.config._attn_implementation = "sdpa"  # noqa: SLF001


def test_slope_tap_delta_of_returns_each_contributors_rows():
    gen = torch.Generator().manual_seed(3)
    shapes = {"a": (4, 5), "b": (7,)}
    grad = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    deltas = [{k: torch.randn(s, generator=gen) for k, s in shapes.items()} for _ in range(3)]
    ids = ["x", "y", "z"]
    with pytest.raises(ScoringInputError, match="`keep_bytes`"):
        SlopeTap(DictDeltaSource(ids, deltas), grad, keep_bytes=-1)
    for keep in (0, 3 * 20 * 4, 1 << 20):  # nothing kept, only "a" kept, everything kept
        tap = SlopeTap(DictDeltaSource(ids, deltas), grad, keep_bytes=keep)
        DeltaSoup(SoupConfig(aggregator="mean")).run(tap, lambda name, t: None)
        for i, d in enumerate(deltas):
            got = tap.delta_of(i)
            assert set(got) == set(shapes)
            assert all(torch.equal(got[k], d[k]) for k in shapes)
