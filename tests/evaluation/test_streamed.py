"""Streamed evaluation and scoring (zoo_gym/evaluation/streamed_model.py) give the whole-model numbers with one
decoder layer resident at a time (and the next one read ahead): held-out loss, loss of base + delta, the scoring
gradient and the order of first-order scores, on the tiny model and random small bases of several families."""

from __future__ import annotations

import pytest
import torch

from zoo_gym.gym_train import Evaluator, default_validation_examples, tiny_model_dir
from zoo_gym.evaluation.evaluate import load_model, tokenize_examples
from zoo_gym.gym_train.families import make_random_base
from zoo_gym.evaluation.packing import PackedScoringSet, supports_packing
from zoo_gym.evaluation.streamed_model import load_streamed, stream_of

EXAMPLES = default_validation_examples(n=12)


@pytest.fixture(scope="module", params=["tiny", "qwen3", "llama", "gpt2", "gemma", "phi3"])
def model_dir(request, tmp_path_factory):
    if request.param == "tiny":
        return tiny_model_dir()
    return make_random_base(request.param, tmp_path_factory.mktemp(request.param))


def _pair(model_dir):
    """(whole-model Evaluator, streamed Evaluator) on the same examples."""
    whole = Evaluator(model_dir, EXAMPLES)
    streamed = Evaluator(model_dir, EXAMPLES, model=load_streamed(model_dir), tokenizer=whole.tokenizer)
    return whole, streamed


def _deltas(model, n: int, seed: int = 0) -> list[dict]:
    """Random deltas on a few decoder-layer matrices and a resident parameter (the final norm or embedding)."""
    g = torch.Generator().manual_seed(seed)
    params = dict(model.named_parameters())
    names = [k for k, p in params.items() if p.dim() == 2 and ".0." in k][:3]
    names += [k for k, p in params.items() if p.dim() == 1 and "layers" not in k and ".h." not in k][:1]
    return [{k: 1e-2 * torch.randn(params[k].shape, generator=g) for k in names} for _ in range(n)]


def test_heldout_loss_equals_whole_model(model_dir):
    whole, streamed = _pair(model_dir)
    assert streamed.model.config._attn_implementation == whole.model.config._attn_implementation
    assert streamed.loss() == pytest.approx(whole.loss(), rel=1e-6)
    stream = stream_of(streamed.model)
    assert stream.max_resident == 2 and stream.loads >= len(stream.layers)  # computing + reading ahead
    assert stream.loads_read_ahead >= len(stream.layers) - 1  # every layer but the first was read ahead
    assert not stream.resident  # dropped after the pass


def test_loss_with_delta_equals_whole_model(model_dir):
    whole, streamed = _pair(model_dir)
    for delta in _deltas(whole.model, 2):
        assert streamed.loss(delta, scale=0.5) == pytest.approx(whole.loss(delta, scale=0.5), rel=1e-6)
    assert streamed.loss() == pytest.approx(whole.loss(), rel=1e-6)  # the delta is gone after
    assert stream_of(streamed.model).max_resident == 2


def test_gradient_and_score_order_equal_whole_model(model_dir):
    whole = load_model(model_dir)
    if not supports_packing(whole):
        pytest.skip("packing needs sdpa or eager attention")
    streamed = load_streamed(model_dir)
    tok = Evaluator(model_dir, EXAMPLES[:1], model=whole).tokenizer
    pairs = tokenize_examples(tok, EXAMPLES)
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    ref = PackedScoringSet(whole, pairs, pad_id=pad)
    got = PackedScoringSet(streamed, pairs, pad_id=pad)
    g_ref, g_got = ref.gradient(), got.gradient()
    assert g_got.base_loss == pytest.approx(g_ref.base_loss, rel=1e-6)
    assert g_got.norm == pytest.approx(g_ref.norm, rel=1e-5)
    assert set(g_got.grad) == set(g_ref.grad)
    for name in g_ref.grad:  # the output layer's gradient is summed in vocabulary blocks: float rounding differs
        scale = float(g_ref.grad[name].abs().max())
        torch.testing.assert_close(g_got.grad[name], g_ref.grad[name], rtol=1e-4, atol=max(1e-7, 1e-5 * scale))
    stream = stream_of(streamed)
    assert stream.max_resident == 2 and not stream.resident
    deltas = _deltas(whole, 5, seed=1)
    slopes = [[float(sum((g.grad[k] * d[k]).sum() for k in d)) for d in deltas] for g in (g_ref, g_got)]
    assert sorted(range(5), key=slopes[0].__getitem__) == sorted(range(5), key=slopes[1].__getitem__)
    for d in deltas[:2]:  # the packed exact check (its own module-by-module delta swap) agrees too
        assert got.loss(d, scale=2.0) == pytest.approx(ref.loss(d, scale=2.0), rel=1e-6)


def test_spilled_gradient_and_one_layer_during_backward(tmp_path):
    """The server's gradient (spilled to disk) equals the in-memory one rounded to bfloat16, and the backward's recompute never
    holds two layers (the count is taken inside every load)."""
    model = load_streamed(tiny_model_dir())
    stream = stream_of(model)
    seen = []
    load = stream.load

    def counting(i):
        load(i)
        seen.append(len(stream.resident))

    stream.load = counting
    tok = Evaluator(tiny_model_dir(), EXAMPLES[:1], model=model).tokenizer
    ps = PackedScoringSet(model, tokenize_examples(tok, EXAMPLES), pad_id=tok.pad_token_id)
    spilled, kept = ps.gradient(spill_dir=tmp_path), ps.gradient()
    assert len(seen) == 4 * len(stream.layers) and max(seen) == 1  # forward + recompute, twice
    for name in kept.grad:  # spilled in bfloat16 (evaluation/spill.py), read back as float32
        assert torch.equal(spilled.grad[name], kept.grad[name].to(torch.bfloat16).float())


def test_reading_ahead_changes_no_number_and_off_holds_one_layer():
    """The reader thread's reads are the same bytes and the same float operations (base + scale x delta) as a
    read on demand: losses with and without a delta and the gradient are bit for bit equal; off, one layer."""
    on, off = load_streamed(tiny_model_dir()), load_streamed(tiny_model_dir())
    stream_of(off).prefetch = False
    tok = Evaluator(tiny_model_dir(), EXAMPLES[:1], model=on).tokenizer
    pairs = tokenize_examples(tok, EXAMPLES)
    a, b = (PackedScoringSet(m, pairs, pad_id=tok.pad_token_id) for m in (on, off))
    delta = _deltas(on, 1, seed=4)[0]
    assert a.loss() == b.loss() and a.loss(delta, scale=0.5) == b.loss(delta, scale=0.5)
    assert a.loss(delta, scale=2.0) == b.loss(delta, scale=2.0) != a.loss()  # a changed delta is read anew
    ga, gb = a.gradient(), b.gradient()
    assert ga.base_loss == gb.base_loss and all(torch.equal(ga.grad[k], gb.grad[k]) for k in gb.grad)
    assert stream_of(on).loads_read_ahead > 0 and stream_of(off).loads_read_ahead == 0
    assert stream_of(off).max_resident == 1 and stream_of(on).max_resident == 2


def test_server_evaluator_streams():
    from zoo_gym.evaluation.server_evaluator import ServerEvaluator

    ev = ServerEvaluator(tiny_model_dir(), default_validation_examples(n=40), scoring_examples=32)
    assert stream_of(ev.base.model) is not None and isinstance(ev.scoring, PackedScoringSet)
    whole = Evaluator(tiny_model_dir(), ev.examples)
    assert ev.heldout_loss() == pytest.approx(whole.loss(), rel=1e-5)
    delta = _deltas(whole.model, 1)[0]
    assert ev.loss(delta, scale=0.3) == pytest.approx(whole.loss(delta, scale=0.3), rel=1e-6)


def test_a_bf16_evaluators_exact_check_measures_the_float32_change():
    """The first-order exact check compares base + delta with the gradient's base loss: in bf16 that loss is a
    bf16 rounding away from float32's, so `solo_loss` carries the delta's float32 change onto it; the gain the
    check sees is float32's, not the rounding."""
    from zoo_gym.evaluation.server_evaluator import ServerEvaluator

    examples = default_validation_examples(n=40)
    ev16, ev32 = (ServerEvaluator(tiny_model_dir(), examples, scoring_examples=32, dtype=d)
                  for d in (torch.bfloat16, torch.float32))
    delta = _deltas(ev32.base.model, 1)[0]
    base16, base32 = ev16.gradient().base_loss, ev32.gradient().base_loss
    assert base16 != base32 and base16 == pytest.approx(base32, rel=1e-3)
    gain16, gain32 = base16 - ev16.solo_loss(delta, scale=3.0), base32 - ev32.solo_loss(delta, scale=3.0)
    assert gain32 != 0 and gain16 == pytest.approx(gain32, abs=1e-6 * base32)


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory):
    """A random Qwen3 base stored in bfloat16, as published checkpoints are."""
    from transformers import AutoTokenizer

    src = make_random_base("qwen3", tmp_path_factory.mktemp("qwen3-f32"))
    out = tmp_path_factory.mktemp("qwen3-bf16")
    load_model(src).to(torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(out)
    return out


@pytest.mark.parametrize("block_rows", [64, None], ids=["blocks-of-64", "one-block"])
def test_vocabulary_weights_stay_bf16_and_give_the_whole_model_numbers(bf16_dir, tmp_path, monkeypatch, block_rows):
    """The embedding / output layer stay in the checkpoint's bf16 and are used a vocabulary block at a time; the loss,
    the loss with a delta on the embedding, the gradient (in memory, spilled) and the slopes' order are the float32
    whole model's."""
    from zoo_gym.evaluation import vocab_blocks

    if block_rows is not None:
        monkeypatch.setattr(vocab_blocks, "BLOCK_ROWS", block_rows)
    whole, streamed = load_model(bf16_dir), load_streamed(bf16_dir)
    vocab = vocab_blocks.vocab_of(streamed)
    assert vocab.embed.weight.dtype == torch.bfloat16 and vocab.head.weight.dtype == torch.bfloat16
    V = vocab.head.weight.shape[0]
    assert block_rows is None or V > 4 * block_rows  # several blocks
    tok = Evaluator(bf16_dir, EXAMPLES[:1], model=whole).tokenizer
    pairs = tokenize_examples(tok, EXAMPLES)
    ref, got = (PackedScoringSet(m, pairs, pad_id=tok.pad_token_id) for m in (whole, streamed))
    assert got.loss() == pytest.approx(ref.loss(), rel=1e-6)
    g = torch.Generator().manual_seed(3)
    embed = next(k for k, p in whole.named_parameters() if p is whole.get_input_embeddings().weight)
    delta = {embed: 1e-2 * torch.randn(whole.get_input_embeddings().weight.shape, generator=g)}
    assert ref.loss(delta, scale=2.0) != pytest.approx(ref.loss(), rel=1e-6)  # the delta matters
    assert got.loss(delta, scale=2.0) == pytest.approx(ref.loss(delta, scale=2.0), rel=1e-6)
    whole_ev = Evaluator(bf16_dir, EXAMPLES, model=whole, tokenizer=tok)
    streamed_ev = Evaluator(bf16_dir, EXAMPLES, model=streamed, tokenizer=tok)
    assert streamed_ev.loss(delta, scale=0.5) == pytest.approx(whole_ev.loss(delta, scale=0.5), rel=1e-6)
    assert vocab.embed.weight.dtype == torch.bfloat16  # the base again after each delta
    g_ref, g_got, g_spill = ref.gradient(), got.gradient(), got.gradient(spill_dir=tmp_path)
    assert g_got.base_loss == pytest.approx(g_ref.base_loss, rel=1e-6)
    assert g_got.norm == pytest.approx(g_ref.norm, rel=1e-5) and g_spill.norm == pytest.approx(g_got.norm, rel=1e-12)
    for name in g_ref.grad:
        scale = float(g_ref.grad[name].abs().max())
        torch.testing.assert_close(g_got.grad[name], g_ref.grad[name], rtol=1e-4, atol=1e-5 * scale)
        assert torch.equal(g_spill.grad[name], g_got.grad[name].to(torch.bfloat16).float())
    assert vocab.head.weight.grad is None and vocab.embed.weight.grad is None
    deltas = [{**d, embed: 1e-2 * torch.randn(delta[embed].shape, generator=g)} for d in _deltas(whole, 5, seed=2)]
    slopes = [[float(sum((gr.grad[k] * d[k]).sum() for k in d)) for d in deltas] for gr in (g_ref, g_got)]
    assert sorted(range(5), key=slopes[0].__getitem__) == sorted(range(5), key=slopes[1].__getitem__)


def test_vocabulary_gradient_is_handed_out_in_blocks(bf16_dir, monkeypatch):
    """Each backward leaves factors only; `finish` hands out the (vocab, hidden) gradient BLOCK_ROWS rows at a time, and
    the blocks make up the whole model's gradient of the embedding / output layer."""
    from zoo_gym.evaluation import vocab_blocks
    from zoo_gym.evaluation.packed_batch import pack_shared_prefix, packed_loss_sum

    monkeypatch.setattr(vocab_blocks, "BLOCK_ROWS", 50)
    whole, streamed = load_model(bf16_dir), load_streamed(bf16_dir)
    tok = Evaluator(bf16_dir, EXAMPLES[:1], model=whole).tokenizer
    batch = pack_shared_prefix(tokenize_examples(tok, EXAMPLES), pad_id=tok.pad_token_id)
    loss, _ = packed_loss_sum(whole, batch)
    loss.backward()
    want = whole.get_output_embeddings().weight.grad                      # (V, H), head and embedding parts
    vocab = vocab_blocks.vocab_of(streamed)
    got: dict[int, list[torch.Tensor]] = {}
    with torch.enable_grad(), vocab.gathering() as vg:
        packed_loss_sum(streamed, batch)[0].backward()
        assert not vg.rows or max(r.shape[0] for r in vg.rows) < want.shape[0]  # rows seen, not (V, H)
        vg.finish(vocab.head.weight, vocab.embed.weight, lambda p, blocks: got.setdefault(id(p), list(blocks)))
    assert vocab.head.weight is vocab.embed.weight and list(got) == [id(vocab.head.weight)]  # tied: once
    blocks = got[id(vocab.head.weight)]
    assert max(b.shape[0] for b in blocks) == 50 and len(blocks) == -(-want.shape[0] // 50)
    torch.testing.assert_close(torch.cat(blocks), want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
    with pytest.raises(RuntimeError, match="gathering"):  # outside gathering: refused, not silently dropped
        with torch.enable_grad():
            packed_loss_sum(streamed, batch)[0].backward()


def test_gradient_in_parts_gathers_every_backward(bf16_dir, monkeypatch):
    """`rows_per_backward` runs one backward per part: the vocabulary gradient sums the factors of all of them."""
    from zoo_gym.evaluation import base_gradient, vocab_blocks
    from zoo_gym.evaluation.packed_batch import pack_shared_prefix

    monkeypatch.setattr(vocab_blocks, "BLOCK_ROWS", 64)
    whole, streamed = load_model(bf16_dir), load_streamed(bf16_dir)
    tok = Evaluator(bf16_dir, EXAMPLES[:1], model=whole).tokenizer
    batch = pack_shared_prefix(tokenize_examples(tok, EXAMPLES), pad_id=tok.pad_token_id, row_tokens=48)
    assert batch.input_ids.shape[0] >= 2
    ref, got = base_gradient(whole, [batch]), base_gradient(streamed, [batch], rows_per_backward=1)
    assert got.base_loss == pytest.approx(ref.base_loss, rel=1e-6) and got.norm == pytest.approx(ref.norm, rel=1e-5)
    for name in ref.grad:
        scale = float(ref.grad[name].abs().max())
        torch.testing.assert_close(got.grad[name], ref.grad[name], rtol=1e-4, atol=1e-5 * scale)


def test_bfloat16_passes_keep_the_float32_numbers(model_dir):
    """In bf16 (the layers' matrices as bf16, float32 accumulation, issue 29) the held-out loss is within 1e-3 of
    float32's, the gradient ranks deltas as float32's does, and base + delta still computes in float32, bit for bit."""
    from zoo_gym.evaluation.packed_batch import pack_shared_prefix, packed_loss_sum

    streamed = load_streamed(model_dir)
    if not supports_packing(streamed):
        pytest.skip("packing needs sdpa or eager attention")
    tok = Evaluator(model_dir, EXAMPLES[:1], model=streamed).tokenizer
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    pairs = tokenize_examples(tok, EXAMPLES)
    ps, stream = PackedScoringSet(streamed, pairs, pad_id=pad), stream_of(streamed)
    batch = pack_shared_prefix(pairs, pad_id=pad)
    deltas = _deltas(streamed, 5, seed=3)
    results = {}
    for dtype in (torch.float32, torch.bfloat16):
        with stream.computing(dtype), torch.no_grad():
            total, count = packed_loss_sum(streamed, batch)
            with torch.enable_grad():
                g = ps.gradient()
            exact = ps.loss(deltas[0], scale=2.0)
        slopes = [float(sum((g.grad[k] * d[k]).sum() for k in d)) for d in deltas]
        results[dtype] = (float(total) / count, g.base_loss, slopes, exact)
    (loss32, base32, slopes32, exact32), (loss16, base16, slopes16, exact16) = results.values()
    assert loss16 != loss32 and loss16 == pytest.approx(loss32, rel=1e-3)  # bf16 did run, and stayed close
    assert base16 == pytest.approx(base32, rel=1e-3)
    assert sorted(range(5), key=slopes16.__getitem__) == sorted(range(5), key=slopes32.__getitem__)
    assert exact16 == exact32  # the delta's pass ran in float32 inside the bf16 block
    assert stream.compute_dtype is torch.float32 and not stream.resident


def test_bf16_layers_are_used_where_they_lie_in_the_file(bf16_dir):
    """Computing in bf16 from a bf16 checkpoint, a layer's matrices are the file's own bytes (a read-only mapping,
    no copy), and every layer's pages leave the process again when it is dropped."""
    import numpy as np

    from zoo_gym.evaluation.packed_batch import pack_shared_prefix, packed_loss_sum

    model = load_streamed(bf16_dir)
    stream = stream_of(model)
    tok = Evaluator(bf16_dir, EXAMPLES[:1], model=model).tokenizer
    batch = pack_shared_prefix(tokenize_examples(tok, EXAMPLES), pad_id=tok.pad_token_id or 0)
    proj = next(m for m in stream.layers[1].modules() if isinstance(m, torch.nn.Linear))
    seen = []
    proj.register_forward_hook(lambda m, args, out: seen.append((m.weight.data_ptr(), m.weight.dtype)))
    with stream.computing(torch.bfloat16), torch.no_grad():
        packed_loss_sum(model, batch)
    start = np.frombuffer(stream._map, dtype=np.uint8).ctypes.data  # noqa: SLF001
    ptr, dtype = seen[0]
    assert dtype is torch.bfloat16 and start <= ptr < start + len(stream._map)  # noqa: SLF001
    assert not stream.resident and not stream._spans  # noqa: SLF001 - every layer's pages dropped
