"""The CUDA-only training options of issue 28 run through the product's train() on the GPU: LoftQ
initialisation (PEFT quantizes the base with bitsandbytes on 'cuda'; the delta is dense, against the
original base), Liger's fused Triton kernels (liger-kernel, carried as a wheel) and flash-attention 2
(flash-attn; skipped with its reason where the package is absent). Each trains the built-in tiny model
on a repeated batch: its held-out loss must fall, and its delta must encode and decode."""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def _train(**options):
    from zoo_gym import codec
    from zoo_gym.gym_train import TrainConfig, builtin_examples, tiny_model_dir, train

    batch = builtin_examples("default", n=8, seed=0)
    cfg = TrainConfig(device="cuda", max_steps=10, batch_size=8, warmup_steps=0, learning_rate=3e-3, **options)
    torch.cuda.reset_peak_memory_stats()
    r = train(tiny_model_dir(), batch * 10, cfg, base_sha256="c" * 64, eval_examples=batch)
    m = r.metadata
    assert m["loss_after"] < m["loss_before"], m
    assert torch.cuda.max_memory_allocated() > 0  # the steps ran on the GPU
    decoded = codec.decode(codec.encode(r.delta, codec="bitdelta", group_size=None))
    assert set(decoded) == set(r.delta)
    return r


def test_loftq_lora_trains_on_cuda_and_sends_a_dense_delta(record_property):
    pytest.importorskip("bitsandbytes")
    r = _train(init_lora_weights="loftq")
    assert r.metadata["delta_format"] == "dense"
    record_property("loftq_tiny_loss", f"{r.metadata['loss_before']:.4f} -> {r.metadata['loss_after']:.4f}")


def test_liger_kernels_train_on_cuda(record_property):
    pytest.importorskip("liger_kernel")
    r = _train(use_liger_kernel=True)
    record_property("liger_tiny_loss", f"{r.metadata['loss_before']:.4f} -> {r.metadata['loss_after']:.4f}")
    # Liger patched transformers for the whole process; train() puts it back, so a CPU model still runs
    from zoo_gym.gym_train import tiny_model_dir
    from zoo_gym.evaluation.evaluate import load_model

    load_model(tiny_model_dir())(input_ids=torch.tensor([[5, 9, 11, 40]]))


@pytest.mark.skipif(importlib.util.find_spec("flash_attn") is None,
                    reason="flash-attn is not installed here (no wheel for this torch and CUDA to carry)")
def test_flash_attention_2_trains_on_cuda():
    _train(attn_implementation="flash_attention_2", bf16=True)
