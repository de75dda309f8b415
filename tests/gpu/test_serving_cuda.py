"""The Triton variant kernel (zoo_gym/serving/kernels_triton.py) against the CPU path, and gym-serve's model
path on CUDA against the same model on the CPU.

Kernel: one bitdelta_linear call at Qwen3-0.6B's gate_proj shape (1024 -> 3072) and q_proj shape, bf16,
a decode batch of 20 rows over 16 variants (log8 scale codes, groups of 128, as served) plus base rows;
the largest difference from the CPU path is recorded, and must stay within bf16 rounding of the output.
The kernel's time against the base matmul alone is recorded too (a figure, not an assertion); the
decode throughput with 16 variants is benchmarks/serving_gpu.py's."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

GROUP = 128


def _variants(out_f: int, in_f: int, n: int, *, seed: int = 0):
    """n random deltas as served: packed signs uint8 (out, in/8), log8 scale codes uint8, their references."""
    from zoo_gym import codec
    from zoo_gym.serving.kernels import log8_scale_codes

    g = torch.Generator().manual_seed(seed)
    signs, codes, refs = [], [], []
    for _ in range(n):
        payload = codec.encode({"w": torch.randn(out_f, in_f, generator=g) * 0.01}, codec="bitdelta",
                               group_size=GROUP, scale_dtype="log8")
        p = codec.read_bitdelta(payload, "w")
        c, r = log8_scale_codes(p.scales)
        signs.append(p.signs)
        codes.append(c)
        refs.append(r)
    return signs, codes, refs


@pytest.mark.parametrize("out_f,in_f,tokens", [(3072, 1024, 1), (2048, 1024, 1), (3072, 1024, 7)])
def test_triton_kernel_equals_the_cpu_path_on_mixed_variants(out_f, in_f, tokens, record_property):
    from zoo_gym.serving.kernels import bitdelta_linear

    signs, codes, refs = _variants(out_f, in_f, 16)
    g = torch.Generator().manual_seed(1)
    weight = (torch.randn(out_f, in_f, generator=g) * 0.02).bfloat16()
    x = torch.randn(20, tokens, in_f, generator=g).bfloat16()
    rows = torch.tensor([v % 16 for v in range(16)] + [-1, 3, -1, 15])  # every variant, repeats, base rows

    cpu = bitdelta_linear(x, weight, None, signs, codes, GROUP, rows, scale_refs=refs)
    gpu = bitdelta_linear(x.cuda(), weight.cuda(), None, [s.cuda() for s in signs], [c.cuda() for c in codes],
                          GROUP, rows, scale_refs=refs)
    torch.cuda.synchronize()

    base = torch.nn.functional.linear(x.float(), weight.float())
    assert (cpu.float() - base)[rows >= 0].abs().max() > 0.05  # the deltas matter
    diff = (gpu.cpu().float() - cpu.float()).abs().max().item()
    scale = cpu.float().abs().max().item()
    record_property(f"triton_vs_cpu_max_abs_diff_{out_f}x{in_f}x{tokens}", diff)
    assert diff <= 2 ** -7 * scale, (diff, scale)  # bf16 keeps 8 bits: one rounding of each output
    torch.testing.assert_close(gpu.cpu()[rows < 0], cpu[rows < 0], rtol=2 ** -6, atol=1e-3)  # the base alone


@pytest.mark.parametrize("form", ["float32", "mixed"])
def test_triton_kernel_takes_float_scales_and_a_batch_mixing_both(form):
    """Variants with float32 scales (scale_refs None, as gym-serve's --float-scales) and a batch that
    mixes them with log8 codes: the GPU gives the CPU path's output (the first GPU run crashed here)."""
    from zoo_gym.serving.kernels import _scales_f32, bitdelta_linear

    out_f, in_f = 2048, 1024
    signs, codes, refs = _variants(out_f, in_f, 4, seed=2)
    floats = [_scales_f32(c, r) for c, r in zip(codes, refs)]
    scales = floats if form == "float32" else [floats[0], codes[1], floats[2], codes[3]]
    scale_refs = [None] * 4 if form == "float32" else [None, refs[1], None, refs[3]]
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(out_f, in_f, generator=g) * 0.02).bfloat16()
    x = torch.randn(6, 1, in_f, generator=g).bfloat16()
    rows = torch.tensor([0, 1, 2, 3, -1, 1])

    cpu = bitdelta_linear(x, weight, None, signs, scales, GROUP, rows, scale_refs=scale_refs)
    gpu = bitdelta_linear(x.cuda(), weight.cuda(), None, [s.cuda() for s in signs], [c.cuda() for c in scales],
                          GROUP, rows, scale_refs=scale_refs)
    diff = (gpu.cpu().float() - cpu.float()).abs().max().item()
    assert diff <= 2 ** -7 * cpu.float().abs().max().item(), diff


def test_kernel_time_against_the_base_matmul(record_property):
    """One adapted linear at a decode step (16 rows, 16 variants) against the base matmul alone (CUDA events)."""
    from zoo_gym.serving.kernels import bitdelta_linear

    signs, codes, refs = _variants(3072, 1024, 16)
    signs, codes = [s.cuda() for s in signs], [c.cuda() for c in codes]
    weight = (torch.randn(3072, 1024) * 0.02).bfloat16().cuda()
    x = torch.randn(16, 1, 1024).bfloat16().cuda()
    rows = torch.arange(16)

    def timed(fn, n=200) -> float:
        for _ in range(10):
            fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / n * 1e3  # microseconds per call

    base_us = timed(lambda: torch.nn.functional.linear(x, weight))
    mixed_us = timed(lambda: bitdelta_linear(x, weight, None, signs, codes, GROUP, rows, scale_refs=refs))
    record_property("linear_3072x1024_base_us", round(base_us, 1))
    record_property("linear_3072x1024_16_variants_us", round(mixed_us, 1))
    assert mixed_us > 0


def test_served_model_on_cuda_equals_the_cpu(record_property):
    """gym-serve's MultiVariantModel on CUDA (float32, so the CPU is the reference): a mixed batch of two
    variants and a base row gives the CPU's logits, and the same greedy tokens."""
    from serving_helpers import random_variant_payload
    from zoo_gym.gym_train import tiny_model_dir
    from zoo_gym.serving.model import MultiVariantModel
    from zoo_gym.serving.variant import variant_from_payload, weights_sha256

    base = tiny_model_dir()
    sha = weights_sha256(base)
    variants = [variant_from_payload(random_variant_payload(base, seed=s), name=f"v{s}", base_sha256=sha)
                for s in (1, 2)]
    prompts = [[5, 9, 11, 40], [7, 8, 30], [12, 13, 14, 15, 16]]
    rows = [variants[0], None, variants[1]]
    out = {}
    for device in ("cpu", "cuda"):
        m = MultiVariantModel.from_dir(base, device=device)
        ids = torch.tensor([p[:3] for p in prompts], device=device)
        with torch.no_grad():
            rows = [m.on_device(v) if v else None for v in rows]  # moves the variant's tensors to `device`
            logits = m.logits(rows, ids, torch.ones_like(ids))
        toks = [row for row, _ in m.generate(rows, prompts, max_new_tokens=[8] * 3, temperature=[0.0] * 3,
                                             eos_ids=set(), pad_id=0)]
        out[device] = (logits.float().cpu(), toks)

    diff = (out["cuda"][0] - out["cpu"][0]).abs().max().item()
    record_property("served_tiny_cuda_vs_cpu_max_logit_diff", diff)
    assert diff <= 1e-3 * out["cpu"][0].abs().max().item()
    assert out["cuda"][1] == out["cpu"][1]
