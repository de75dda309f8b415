"""codec="auto": the smallest candidate within max_rel_error, recorded in the manifest."""

from __future__ import annotations

import math

import pytest
import torch

from zoo_gym.codec import LoraFactors, decode, encode, read_manifest, relative_error


def _gauss(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * 1e-3


@pytest.mark.parametrize(
    "max_rel_error,expected",
    [(0.7, "bitdelta"), (0.3, "int4"), (0.05, "int8"), (0.001, "fp16"), (0.0, "fp32")],
)
def test_auto_picks_the_smallest_codec_within_the_bound(max_rel_error, expected):
    # Gaussian: bitdelta 0.60, int4 ~0.12, int8 ~0.007, fp16 ~2e-4, fp32 exact
    x = _gauss((64, 256), 0)
    payload = encode({"x": x}, codec="auto", max_rel_error=max_rel_error)
    e = read_manifest(payload).entries[0]
    assert e.codec == expected
    assert relative_error(decode(payload)["x"], x) <= max_rel_error


def test_auto_on_bf16_uses_bf16_passthrough_as_the_exact_fallback():
    x = _gauss((8, 64), 1).bfloat16()
    payload = encode({"x": x}, codec="auto", max_rel_error=0.0)
    assert read_manifest(payload).entries[0].codec == "bf16"
    assert torch.equal(decode(payload)["x"], x)


def test_auto_keeps_lora_factors_when_they_are_smaller():
    # rank 8 on 1024x1024: factors 2*8*2048 fp16 bytes = 32 KiB < 128 KiB of signs
    g = torch.Generator().manual_seed(2)
    f = LoraFactors(torch.randn(8, 1024, generator=g) * 0.01, torch.randn(1024, 8, generator=g) * 0.01)
    payload = encode({"w": f, "norm": _gauss((1024,), 3)}, codec="auto")
    m = read_manifest(payload)
    assert (m.entry("w").codec, m.entry("w").rank, m.entry("norm").codec) == ("lora", 8, "fp16")
    assert relative_error(decode(payload)["w"], f.merged()) < 1e-3


def test_auto_prefers_a_sign_code_of_a_small_lora_matrix_only_within_the_bound():
    # 64x64 rank 8: signs (512 B + scales) are smaller than fp16 factors (2 KiB)
    g = torch.Generator().manual_seed(4)
    f = LoraFactors(torch.randn(8, 64, generator=g), torch.randn(64, 8, generator=g))
    err = relative_error(decode(encode({"w": f}, codec="bitdelta", group_size=None))["w"], f.merged())
    chosen = read_manifest(encode({"w": f}, codec="auto", group_size=None)).entries[0].codec
    assert chosen == ("bitdelta" if err <= 0.7 else "int4")
    tight = read_manifest(encode({"w": f}, codec="auto", group_size=None, max_rel_error=0.01)).entries[0].codec
    assert tight == "int8" or tight == "lora"


def test_auto_default_bound_sits_above_the_gaussian_sign_code_error():
    assert math.sqrt(1 - 2 / math.pi) < 0.7


def test_auto_skips_fp16_when_values_overflow_it():
    x = torch.linspace(-2e5, 3e5, 32).reshape(4, 8)  # beyond fp16's 65504, not exactly representable by ints
    payload = encode({"x": x}, codec="auto", max_rel_error=0.0)
    assert read_manifest(payload).entries[0].codec == "fp32"
    assert torch.equal(decode(payload)["x"], x)
