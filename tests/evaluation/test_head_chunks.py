"""The output layer only at scored positions, in chunks (``evaluation.evaluate.head_loss_sum``): the
loss, padded and packed, and the gradient equal the full-logits reference on the tiny model and on
small random GPT-2 / Llama / Qwen3 / Gemma / Phi-3 bases; chunks never hold every position's
logits; ``SlopeTap.delta_of`` builds one tensor per read."""

from __future__ import annotations

import pytest
import torch

from zoo_gym.aggregation import DeltaSoup, SoupConfig
from zoo_gym.aggregation.sources import DictDeltaSource
from zoo_gym.gym_train import default_validation_examples, tiny_model_dir
from zoo_gym.evaluation import evaluate as ev
from zoo_gym.evaluation.evaluate import collate, completion_loss_sum, load_model, load_tokenizer, tokenize_examples
from zoo_gym.gym_train.families import make_random_base
from zoo_gym.evaluation import base_gradient
from zoo_gym.rewards import SlopeTap
from zoo_gym.evaluation.packed_batch import pack_shared_prefix, packed_loss_sum

BASES = ("tiny", "gpt2", "llama", "qwen3", "gemma", "phi3")


@pytest.fixture(scope="module", params=BASES)
def base(request, tmp_path_factory):
    d = tiny_model_dir() if request.param == "tiny" else make_random_base(
        request.param, tmp_path_factory.mktemp(request.param), seed=1)
    tok = load_tokenizer(d)
    model = load_model(d, attn_implementation="sdpa").eval()
    pairs = tokenize_examples(tok, default_validation_examples(n=12))
    return request.param, model, pairs


def _full_logits_padded(model, batch) -> tuple[torch.Tensor, int]:
    """The reference: logits at every position, cross-entropy over the completion labels."""
    ids, mask, labels = batch
    logits = model(input_ids=ids, attention_mask=mask).logits                # (B, T, V)
    shift = labels[:, 1:]
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]),
                                             shift.reshape(-1), ignore_index=-100, reduction="sum")
    return loss, int((shift != -100).sum())


def _full_logits_packed(model, b) -> torch.Tensor:
    logits = model(input_ids=b.input_ids, position_ids=b.position_ids, attention_mask=b.allowed,
                   use_cache=False).logits                                   # (R, T, V)
    picked = logits.reshape(-1, logits.shape[-1])[b.predict_at]              # (K, V)
    return torch.nn.functional.cross_entropy(picked.float(), b.targets, reduction="sum")


@pytest.fixture(params=[1 << 24, 3 * 4096])  # one chunk; chunks of 3 rows at the tiny vocabulary
def chunk(request, monkeypatch):
    monkeypatch.setattr(ev, "HEAD_CHUNK_ELEMENTS", request.param)
    return request.param


def test_padded_loss_equals_full_logits(base, chunk):
    name, model, pairs = base
    batch = collate(pairs, pad_id=0)
    with torch.no_grad():
        ref, n_ref = _full_logits_padded(model, batch)
        got, n = completion_loss_sum(model, [batch])
    assert n == n_ref > 0
    assert got / n == pytest.approx(float(ref) / n_ref, rel=1e-5, abs=1e-6), name


def test_packed_loss_equals_full_logits(base, chunk):
    name, model, pairs = base
    b = pack_shared_prefix(pairs, pad_id=0, row_tokens=48)
    assert b.input_ids.shape[0] > 1  # several rows: the per-row backward below has parts to add
    with torch.no_grad():
        ref = _full_logits_packed(model, b)
        got, n = packed_loss_sum(model, b)
    assert n == b.tokens
    assert float(got) == pytest.approx(float(ref), rel=1e-5), name


def test_gradient_equals_one_full_logits_backward(base, chunk):
    name, model, pairs = base
    b = pack_shared_prefix(pairs, pad_id=0, row_tokens=48)
    model.zero_grad(set_to_none=True)
    (_full_logits_packed(model, b) / b.tokens).backward()
    ref = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    for rows in (1, 100):  # a backward per row; one for all rows
        g = base_gradient(model, [b], rows_per_backward=rows)
        assert g.tokens == b.tokens and g.examples == b.examples == len(pairs)
        assert all(p.grad is None for p in model.parameters())
        scale = max(float(t.abs().max()) for t in ref.values())
        assert scale > 0  # the check can fail: there is a gradient to compare
        for k, r in ref.items():
            torch.testing.assert_close(g.grad[k], r, rtol=1e-4, atol=1e-6 * scale, msg=f"{name} {k}")
    padded = base_gradient(model, [collate(pairs, pad_id=0)])
    assert padded.base_loss == pytest.approx(g.base_loss, rel=1e-5)


def test_chunks_never_hold_every_positions_logits(monkeypatch):
    # Prepare: record the rows of every logits tensor the output layer produces
    model = load_model(tiny_model_dir(), attn_implementation="sdpa").eval()
    tok = load_tokenizer(tiny_model_dir())
    b = pack_shared_prefix(tokenize_examples(tok, default_validation_examples(n=16)), pad_id=0)
    vocab = model.get_output_embeddings().weight.shape[0]
    monkeypatch.setattr(ev, "HEAD_CHUNK_ELEMENTS", 8 * vocab)
    rows: list[int] = []
    h = model.get_output_embeddings().register_forward_hook(
        lambda _m, _a, out: rows.append(out.reshape(-1, out.shape[-1]).shape[0]))
    try:
        # Execute
        with torch.no_grad():
            packed_loss_sum(model, b)
    finally:
        h.remove()
    # Assert: no logits in the body's forward, then chunks of at most 8 scored positions
    assert rows[0] == 0 and max(rows) <= 8 and sum(rows) == b.tokens


def test_delta_of_builds_one_tensor_per_read():
    gen = torch.Generator().manual_seed(5)
    shapes = {"a": (4, 5), "b": (7,)}
    grad = {k: torch.randn(s, generator=gen) for k, s in shapes.items()}
    deltas = [{k: torch.randn(s, generator=gen) for k, s in shapes.items()} for _ in range(2)]

    class Counting(DictDeltaSource):
        reads: list[str] = []

        def stacked_one(self, i, name):
            self.reads.append(name)
            return super().stacked(name)[i]

    src = Counting(["x", "y"], deltas)
    tap = SlopeTap(src, grad, keep_bytes=0)
    DeltaSoup(SoupConfig(aggregator="mean")).run(tap, lambda name, t: None)
    lazy = tap.delta_of(1)
    assert src.reads == [] and list(lazy) == ["a", "b"] and len(lazy) == 2
    assert torch.equal(lazy["b"], deltas[1]["b"]) and src.reads == ["b"]
    with pytest.raises(KeyError):
        lazy["c"]
