"""Error feedback and BitDelta scale distillation against the real codec."""

import pytest
import torch
from safetensors.torch import load_file
from torch.func import functional_call

from zoo_gym import codec
from zoo_gym.codec import LoraFactors
from zoo_gym.gym_train import ErrorFeedback, builtin_examples, distill_bitdelta_scales, tiny_model_dir
from zoo_gym.gym_train.distill import group_mean_abs
from zoo_gym.evaluation.evaluate import collate, load_model, load_tokenizer, tokenize_examples

BASE = tiny_model_dir()


def _synthetic_delta(seed=0, names=None):
    g = torch.Generator().manual_seed(seed)
    base = load_file(str(BASE / "model.safetensors"))
    names = names or [k for k in base if base[k].dim() == 2 and ".layers." in k]
    # a heavy-tailed delta so that one scale per group is a poor fit (room for distillation)
    return {k: 0.02 * torch.randn(base[k].shape, generator=g) ** 3 for k in names}


def test_error_feedback_adds_what_the_codec_lost(tmp_path):
    d = {"a": torch.tensor([[0.3, -0.1, 0.05, 0.2, -0.4, 0.1, 0.0, 0.7]]),
         "b": LoraFactors(A=torch.ones(1, 2), B=torch.full((2, 1), 0.5))}
    ef = ErrorFeedback(tmp_path / "ef" / "residual.safetensors")
    assert ef.add_to(d) is not d and ef.add_to(d)["a"] is d["a"]  # nothing stored yet: unchanged
    sent = ef.add_to(d)
    decoded = codec.decode(codec.encode(sent, codec="bitdelta", group_size=-1))
    ef.update(sent, decoded)
    ef2 = ErrorFeedback(tmp_path / "ef" / "residual.safetensors")  # persisted across processes/rounds
    res = ef2.residual()
    assert torch.allclose(res["a"], d["a"] - decoded["a"])
    assert torch.allclose(res.get("b", torch.zeros(2, 2)), d["b"].merged() - decoded["b"])  # absent: nothing lost
    nxt = ef2.add_to({"a": torch.zeros(1, 8)})
    assert torch.allclose(nxt["a"], d["a"] - decoded["a"])
    # over two rounds the decoded sum tracks the true sum better than without feedback
    ef2.reset()
    assert ef2.residual() == {}


def test_error_feedback_shrinks_accumulated_error(tmp_path):
    g = torch.Generator().manual_seed(0)
    rounds = [{"w": torch.randn(16, 64, generator=g) ** 3} for _ in range(6)]
    ef = ErrorFeedback(tmp_path / "r.safetensors")
    sum_true = sum(r["w"] for r in rounds)
    sum_ef = torch.zeros(16, 64)
    sum_plain = torch.zeros(16, 64)
    for r in rounds:
        sent = ef.add_to(r)
        dec = codec.decode(codec.encode(sent, codec="bitdelta", group_size=-1))
        ef.update(sent, dec)
        sum_ef += dec["w"]
        sum_plain += codec.decode(codec.encode(r, codec="bitdelta", group_size=-1))["w"]
    # telescoping: what is still missing from the sum is exactly the one residual the client holds
    assert torch.allclose(sum_true - sum_ef, ef.residual()["w"], atol=1e-4)
    assert (sum_ef - sum_true).norm() < 0.8 * (sum_plain - sum_true).norm()


def _logit_mse(delta, examples):
    tok, model = load_tokenizer(BASE), load_model(BASE)
    params = dict(model.named_parameters())
    ids, m, _ = collate(tokenize_examples(tok, examples), pad_id=tok.pad_token_id)
    true_delta = _synthetic_delta()
    teacher = {k: p + true_delta[k] if k in true_delta else p for k, p in params.items()}
    with torch.no_grad():
        t = functional_call(model, teacher, args=(), kwargs={"input_ids": ids, "attention_mask": m}).logits
        s = functional_call(model, {k: p + delta[k] if k in delta else p for k, p in params.items()}, args=(),
                            kwargs={"input_ids": ids, "attention_mask": m}).logits
    mask = m.unsqueeze(-1).float()
    return float((((s - t) ** 2) * mask).sum() / mask.sum())


@pytest.mark.slow
def test_distillation_keeps_signs_lowers_logit_error_and_reencodes_to_its_scales():
    delta = _synthetic_delta()
    calib = builtin_examples("default", n=16, seed=3)
    held = builtin_examples("default", split="validation", n=16)
    plain = distill_bitdelta_scales(BASE, delta, group_size=None, calib_examples=calib, steps=0, lr=1e-4)
    dist = distill_bitdelta_scales(BASE, delta, group_size=None, calib_examples=calib, steps=15, lr=2e-4,
                                   generator=torch.Generator().manual_seed(0))
    k = "model.layers.1.mlp.down_proj.weight"
    # steps=0 is exactly the codec's own mean-|x| code
    assert torch.allclose(plain[k], codec.decode(codec.encode({k: delta[k]}, codec="bitdelta", group_size=None))[k])
    for name, d in dist.items():
        assert torch.equal(torch.sign(d), torch.where(delta[name] >= 0, 1.0, -1.0))  # signs frozen
        scales = group_mean_abs(d, group_size=None)  # (rows, 1), all > 0
        assert bool((scales > 0).all())
        redecoded = codec.decode(codec.encode({name: d}, codec="bitdelta", group_size=None))[name]
        assert torch.allclose(redecoded, d, rtol=1e-6, atol=0)  # the codec reproduces the distilled scales
    assert not torch.equal(dist[k], plain[k])
    assert _logit_mse(dist, held) < _logit_mse(plain, held)


def test_group_mean_abs_matches_the_codec_groups():
    x = torch.tensor([[1.0, -2.0, 3.0, -4.0, 5.0, 6.0, 0.0, -1.0, 2.0, 2.0]])
    assert group_mean_abs(x, group_size=8).tolist() == [[22 / 8, 2.0]]
    assert group_mean_abs(x, group_size=None)[0].tolist() == pytest.approx([2.6])
    assert group_mean_abs(torch.stack([x[0], -x[0] * 3]), group_size=-1)[0].tolist() == pytest.approx([5.2])


def test_lora_factors_sent_as_factors_leave_no_residual_and_the_next_delta_stays_factors(tmp_path):
    """LoRA factors sent as factors are not carried densely: no residual is stored, and the next round's
    factors are not merged into a dense delta (the dense residual of their fp16 rounding made a 0.6B
    contributor hold and write 1.76 GB each round, and sent round 2 as 1-bit dense)."""
    from zoo_gym import codec
    from zoo_gym.codec import LoraFactors
    from zoo_gym.gym_train.error_feedback import DecodedPayload

    g = torch.Generator().manual_seed(0)
    delta = {"w": LoraFactors(A=torch.randn(8, 1024, generator=g), B=torch.randn(1024, 8, generator=g)),
             "v": torch.randn(8, generator=g)}
    ef = ErrorFeedback(tmp_path / "r.safetensors")
    sent = ef.add_to(delta)
    payload = codec.encode(sent, codec="auto")
    assert codec.read_manifest(payload).entry("w").codec == "lora"  # sent as factors
    ef.update(sent, DecodedPayload(payload))  # factors decoded as factors (as join does): compared, not densified
    assert "w" not in ef.residual()  # (the 1-D "v" may be sent as fp16: that loss is carried)
    again = ef.add_to(delta)
    assert isinstance(again["w"], LoraFactors)
