"""Training on CUDA through the product's train(): bf16 LoRA on a Qwen3-0.6B-shaped model (random
weights built here, benchmarks/scale.py's SIZES; nothing downloaded), QLoRA 4-bit through bitsandbytes'
CUDA kernels with the LoRA gradient checked against the dequantized float32 reference, and DP-SGD
(Opacus) on LoRA. Each asserts that the work ran on the GPU (its peak CUDA memory). And a kept variant's
scale distillation on the GPU against the CPU's."""

from __future__ import annotations

import copy
import math

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _peak_gib() -> float:
    return torch.cuda.max_memory_allocated() / 2**30


@pytest.fixture(scope="module")
def model_0_6b(tmp_path_factory):
    from benchmarks.scale import build_model

    out = tmp_path_factory.mktemp("qwen3-0.6b")
    n = build_model("0.6b", out)
    assert n == 596_049_920  # Qwen3-0.6B's parameter count (FINDINGS.md)
    return out


def test_bf16_lora_on_a_0_6b_model_lowers_the_loss_of_a_repeated_batch(model_0_6b, record_property):
    from zoo_gym.gym_train import TrainConfig, builtin_examples, train

    batch = builtin_examples("default", n=8, seed=0)
    cfg = TrainConfig(method="lora", device="cuda", bf16=True, max_steps=8, batch_size=8, learning_rate=1e-3,
                      warmup_steps=0, max_length=64)
    torch.cuda.reset_peak_memory_stats()

    r = train(model_0_6b, batch * 8, cfg, base_sha256="0" * 64, eval_examples=batch)

    m = r.metadata
    assert m["steps"] == 8
    assert math.isfinite(m["loss_before"]) and math.isfinite(m["loss_after"])
    assert m["loss_after"] < m["loss_before"], m  # the same 8 examples, trained on 8 times
    # the frozen base lived on the GPU in bf16 (1.1 GiB), and no float32 copy of it (2.2 GiB) did
    assert 1.0 < _peak_gib() < 2.2, _peak_gib()
    assert all(torch.isfinite(f.A).all() and torch.isfinite(f.B).all() for f in r.delta.values())
    record_property("lora_0.6b_bf16_seconds_per_step", m["train_seconds"] / m["steps"])
    record_property("lora_0.6b_bf16_loss", f"{m['loss_before']:.4f} -> {m['loss_after']:.4f}")
    record_property("lora_0.6b_bf16_peak_gib", round(_peak_gib(), 2))


def _lora_grads(model, ids, mask, labels, cfg) -> dict:
    """The LoRA gradients of ``model`` with seeded A and B, the way qlora.lora_gradient_mismatch takes them."""
    from peft import get_peft_model

    torch.manual_seed(0)  # identical random A and B in every model
    pm = get_peft_model(model, copy.deepcopy(cfg))
    pm.train()
    pm.zero_grad()
    pm(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
    return {k: p.grad.detach().float().cpu() for k, p in pm.named_parameters() if p.requires_grad and p.grad is not None}


def _mismatch(g: dict, ref: dict) -> float:
    assert set(g) == set(ref) and ref
    return max(float((g[k] - ref[k]).norm() / ref[k].norm().clamp(min=1e-12)) for k in ref)


def test_qlora_gradient_on_cuda_equals_the_dequantized_reference(record_property):
    """bitsandbytes' CUDA 4-bit LoRA gradient against an fp32 model holding the same dequantized weights,
    within the product's own bound (qlora.GRAD_RTOL); the bound can fail: against the original, not
    dequantized, weights the same gradients differ by more."""
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM

    from zoo_gym.gym_train import builtin_examples, tiny_model_dir
    from zoo_gym.evaluation.evaluate import collate, load_tokenizer, tokenize_examples
    from zoo_gym.gym_train.qlora import GRAD_RTOL, dequantized_reference, load_4bit_model

    base = tiny_model_dir()
    tok = load_tokenizer(base)
    ids, mask, labels = (t.cuda() for t in collate(tokenize_examples(tok, builtin_examples("default", n=8, seed=99)),
                                                   pad_id=tok.pad_token_id))
    cfg = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False, task_type="CAUSAL_LM")
    m4 = load_4bit_model(base)
    assert next(m4.parameters()).is_cuda
    ref = dequantized_reference(m4).cuda()
    orig = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).cuda()

    g4 = _lora_grads(m4, ids, mask, labels, cfg)
    g_ref = _lora_grads(ref, ids, mask, labels, cfg)
    g_orig = _lora_grads(orig, ids, mask, labels, cfg)

    err, err_orig = _mismatch(g4, g_ref), _mismatch(g_orig, g_ref)
    record_property("qlora_grad_rel_diff_vs_dequantized", err)
    record_property("qlora_grad_rel_diff_original_vs_dequantized", err_orig)
    assert err_orig > GRAD_RTOL  # the check sees the 4-bit rounding when it is there ...
    assert err <= GRAD_RTOL  # ... and the CUDA 4-bit path has none beyond it


def test_qlora_trains_on_cuda_and_sends_lora_factors():
    from zoo_gym.codec import LoraFactors
    from zoo_gym.gym_train import TrainConfig, builtin_examples, tiny_model_dir, train
    from zoo_gym.gym_train.qlora import check_qlora

    check_qlora(tiny_model_dir())  # offered on CUDA (bitsandbytes' supported path)
    cfg = TrainConfig(method="lora", quantization="4bit", device="cuda", max_steps=4, batch_size=8, warmup_steps=0)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()

    r = train(tiny_model_dir(), builtin_examples("default", n=64), cfg, base_sha256="q" * 64)

    assert r.metadata["quantization"] == "4bit" and r.metadata["steps"] == 4
    assert r.delta and all(isinstance(v, LoraFactors) for v in r.delta.values())
    assert any(float(v.B.abs().max()) > 0 for v in r.delta.values())
    assert torch.cuda.max_memory_allocated() > before  # the 4-bit model trained on the GPU


def test_dp_sgd_on_lora_runs_on_cuda(record_property):
    """DP-SGD (Opacus, per-example clipping + noise) on the LoRA parameters with device='cuda': the epsilon
    is the RDP accountant's, the delta finite, and the steps ran on the GPU."""
    from opacus.accountants import RDPAccountant

    from zoo_gym.gym_train import TrainConfig, builtin_examples, default_validation_examples, tiny_model_dir, train

    cfg = TrainConfig(method="lora", device="cuda", max_steps=3, batch_size=8, warmup_steps=0,
                      dp_noise_multiplier=1.1, dp_max_grad_norm=0.5)
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()

    r = train(tiny_model_dir(), builtin_examples("default", n=80, seed=1), cfg, base_sha256="d" * 64,
              eval_examples=default_validation_examples(8))

    acc = RDPAccountant()
    for _ in range(3):
        acc.step(noise_multiplier=1.1, sample_rate=8 / 80)
    assert r.metadata["epsilon"] == pytest.approx(acc.get_epsilon(delta=1e-5), rel=1e-9)
    assert all(torch.isfinite(f.A).all() and torch.isfinite(f.B).all() for f in r.delta.values())
    record_property("dp_lora_peak_cuda_bytes", torch.cuda.max_memory_allocated() - before)
    assert torch.cuda.max_memory_allocated() > before, "DP-SGD trained on the CPU although device='cuda'"


def test_scale_distillation_on_cuda_matches_the_cpu(record_property):
    """BitDelta's scale distillation (a kept variant's calibration) on the GPU gives the CPU's scales: the same
    signs, each distilled tensor within float32 rounding of Adam's steps on the CPU."""
    from safetensors.torch import load_file

    from zoo_gym.gym_train import builtin_examples, distill_bitdelta_scales, tiny_model_dir

    base = tiny_model_dir()
    weights = load_file(str(base / "model.safetensors"))
    g = torch.Generator().manual_seed(0)
    delta = {k: 0.02 * torch.randn(w.shape, generator=g) ** 3 for k, w in weights.items()
             if w.dim() == 2 and ".layers." in k}
    calib = builtin_examples("default", n=16, seed=3)
    out = {dev: distill_bitdelta_scales(base, delta, group_size=128, calib_examples=calib, steps=10, lr=2e-4,
                                        generator=torch.Generator().manual_seed(0), device=dev)
           for dev in ("cpu", "cuda")}
    worst = max(float(((out["cuda"][k] - out["cpu"][k]).abs().max() / out["cpu"][k].abs().max())) for k in delta)
    record_property("distill_cuda_vs_cpu_max_relative_diff", worst)
    assert all(out["cuda"][k].device.type == "cpu" for k in delta)  # returned on the CPU, as the codec takes it
    assert all(torch.equal(torch.sign(out["cuda"][k]), torch.sign(out["cpu"][k])) for k in delta)
    assert worst < 1e-3
