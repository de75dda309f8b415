"""Round trips: lossless codecs are exact; lossy ones equal a slow obvious reference; any buffer type works."""

from __future__ import annotations

import math
import mmap

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zoo_gym.codec import (
    LoraFactors,
    decode,
    decode_factors,
    decode_tensor,
    encode,
    read_bitdelta,
    read_manifest,
    sha256_hex,
)

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _randn(shape, *, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _view2d(x):
    if x.dim() <= 1:
        return x.reshape(1, -1)
    return x.reshape(x.shape[0], -1)


def _ref_groups(cols, group_size):
    g = cols if group_size is None or group_size == -1 or group_size >= cols else group_size
    return [(s, min(s + g, cols)) for s in range(0, cols, g)]


def reference_bitdelta(x, group_size):
    """Slow obvious reference: per group mean |x| (float64 -> float32), then scale * sign."""
    x2 = _view2d(x).double()
    out = torch.empty_like(x2, dtype=torch.float32)
    if group_size == -1:
        s = torch.tensor(x2.abs().mean().item(), dtype=torch.float32)
        return torch.where(x2 >= 0, s, -s).float()
    for a, b in _ref_groups(x2.shape[1], group_size):
        s = x2[:, a:b].abs().mean(dim=1).float().unsqueeze(1)  # (rows, 1)
        out[:, a:b] = torch.where(x2[:, a:b] >= 0, s, -s)
    return out


def reference_int(x, group_size, qmax):
    x2 = _view2d(x).float()
    out = torch.empty_like(x2)
    spans = [(0, x2.shape[1])] if group_size == -1 else _ref_groups(x2.shape[1], group_size)
    if group_size == -1:
        s = x2.abs().max() / qmax
        q = torch.zeros_like(x2) if s == 0 else torch.round(x2 / s).clamp(-qmax, qmax)
        return q * s
    for a, b in spans:
        s = x2[:, a:b].abs().amax(dim=1, keepdim=True) / qmax  # (rows, 1)
        q = torch.where(s > 0, torch.round(x2[:, a:b] / torch.where(s > 0, s, 1)).clamp(-qmax, qmax), 0)
        out[:, a:b] = q * s
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_fp32_passthrough_is_exact_for_every_dtype(dtype):
    # Prepare
    delta = {"w": _randn((7, 13), seed=1, dtype=dtype), "b": _randn((13,), seed=2, dtype=dtype)}
    # Execute
    out = decode(encode(delta, codec="fp32"))
    # Assert: bitwise equal, original dtype
    for k, v in delta.items():
        assert out[k].dtype == dtype and torch.equal(out[k], v)


@pytest.mark.parametrize("codec,dtype", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_half_passthrough_is_exact_for_its_own_dtype(codec, dtype):
    x = _randn((5, 3, 4), seed=3, dtype=dtype)
    assert torch.equal(decode(encode({"x": x}, codec=codec))["x"], x)


def test_fp16_of_fp32_is_the_fp16_rounding():
    x = _randn((9, 9), seed=4)
    out = decode(encode({"x": x}, codec="fp16"))["x"]
    assert out.dtype == torch.float32 and torch.equal(out, x.half().float())


shapes = st.lists(st.integers(1, 19), min_size=0, max_size=3).map(tuple)
group_sizes = st.sampled_from([8, 16, 128, None, -1])


@settings(max_examples=60, deadline=None)
@given(shape=shapes, dtype=st.sampled_from(DTYPES), codec=st.sampled_from(["bitdelta", "int8", "int4"]),
       group_size=group_sizes, seed=st.integers(0, 2**16))
def test_lossy_codecs_match_the_slow_reference(shape, dtype, codec, group_size, seed):
    # Prepare: force even 0-D/1-D tensors through the codec
    x = _randn(shape, seed=seed, dtype=dtype)
    # Execute
    # float32 scales: the slow reference computes the exact group mean |x| (log8 is tested on its own)
    payload = encode({"x": x}, codec=codec, group_size=group_size, vector_codec=codec, scale_dtype="float32")
    out = decode(payload)["x"]
    # Assert
    assert out.shape == x.shape and out.dtype == dtype
    if codec == "bitdelta":
        # decode is exactly stored-scale * sign; the stored scale is the group mean |x| up to float32 rounding
        packed = read_bitdelta(payload, "x")
        s = torch.repeat_interleave(packed.scales, packed.group_counts(), dim=1)  # (rows, cols)
        x2 = _view2d(x.float())
        assert torch.equal(out, torch.where(x2 >= 0, s, -s).reshape(x.shape).to(dtype))
        ref = reference_bitdelta(x.float(), group_size)
        torch.testing.assert_close(packed.to_dense(), ref, rtol=1e-6, atol=0)
    else:
        ref = reference_int(x.float(), group_size, 127 if codec == "int8" else 7)
        assert torch.equal(out, ref.reshape(x.shape).to(dtype))
    assert read_manifest(payload).entries[0].codec == codec


@settings(max_examples=40, deadline=None)
@given(shape=shapes, dtype=st.sampled_from(DTYPES),
       codec=st.sampled_from(["bitdelta", "int8", "int4", "fp16", "bf16", "fp32", "lora", "auto"]),
       group_size=group_sizes, seed=st.integers(0, 2**16))
def test_every_codec_keeps_names_shapes_dtypes_and_1d_stays_vector_codec(shape, dtype, codec, group_size, seed):
    delta = {"m": _randn((3,) + shape, seed=seed, dtype=dtype), "v": _randn((11,), seed=seed + 1, dtype=dtype)}
    payload = encode(delta, codec=codec, group_size=group_size)
    out = decode(payload)
    m = read_manifest(payload)
    assert list(out) == ["m", "v"] and m.names == ["m", "v"]
    for k in delta:
        assert out[k].shape == delta[k].shape and out[k].dtype == dtype
    v_codec = m.entry("v").codec
    assert v_codec == (codec if codec in ("fp16", "bf16", "fp32") else "fp16")
    assert m.payload_size == len(payload)


def test_int8_error_is_at_most_half_a_step():
    x = _randn((16, 300), seed=5)
    out = decode(encode({"x": x}, codec="int8", group_size=128))["x"]
    step = torch.cat([x[:, a:b].abs().amax(1, keepdim=True).expand(-1, b - a) for a, b in _ref_groups(300, 128)], 1) / 127
    assert bool(((out - x).abs() <= step / 2 + 1e-7).all())


def test_lora_factors_are_kept_and_merged_on_decode():
    # Prepare: scaling folded into B; fp32 factors -> exact
    f = LoraFactors(A=_randn((4, 24), seed=6), B=_randn((10, 4), seed=7) * 0.5)
    payload = encode({"q_proj": f, "norm": _randn((10,), seed=8)}, codec="lora", lora_codec="fp32")
    # Execute
    out = decode(payload)
    back = decode_factors(payload, "q_proj")
    e = read_manifest(payload).entry("q_proj")
    # Assert
    assert (e.codec, e.rank, e.shape, [x.name for x in e.factors]) == ("lora", 4, (10, 24), ["A", "B"])
    assert torch.equal(back.A, f.A) and torch.equal(back.B, f.B)
    assert torch.equal(out["q_proj"], f.merged())
    assert torch.equal(decode_tensor(payload, "q_proj"), f.merged())


def test_the_norm_from_what_was_sent_is_the_decoded_tensors():
    """sent_sq_norm measures float32 LoRA factors and BitDelta without decoding (the upload check and the
    round's validation use it) and gives nothing for what it cannot vouch for: the caller then decodes."""
    from zoo_gym.codec import sent_sq_norm

    f = LoraFactors(A=_randn((4, 24), seed=11), B=_randn((10, 4), seed=12))
    w = _randn((10, 300), seed=13)
    cases = {"lora fp32": (encode({"t": f}, codec="lora", lora_codec="fp32"), True),
             "bitdelta": (encode({"t": w}, codec="bitdelta"), True),
             "lora fp16 factors": (encode({"t": f}, codec="lora", lora_codec="fp16"), True),
             "bfloat16 bitdelta": (encode({"t": w.bfloat16()}, codec="bitdelta"), False),
             "int8": (encode({"t": w}, codec="int8"), False)}
    for name, (payload, vouched) in cases.items():
        got = sent_sq_norm(payload, "t")
        if not vouched:
            assert got is None, name
            continue
        want = float(decode_tensor(payload, "t").double().square().sum())
        assert math.isclose(got, want, rel_tol=1e-6), name
    huge = LoraFactors(A=f.A * 1e20, B=f.B * 1e20)  # each product element could pass float32's range: decode
    assert sent_sq_norm(encode({"t": huge}, codec="lora", lora_codec="fp32"), "t") is None


def test_lora_factors_under_a_dense_codec_are_merged_first():
    f = LoraFactors(A=_randn((2, 8), seed=9), B=_randn((6, 2), seed=10))
    out = decode(encode({"w": f}, codec="fp32"))["w"]
    assert torch.equal(out, f.merged())


def test_any_buffer_type_decodes_identically(tmp_path):
    delta = {"a": _randn((33, 70), seed=11), "b": _randn((70,), seed=12)}
    payload = encode(delta, codec="bitdelta", metadata={"round": 3, "note": "x"})
    ref = decode(payload)
    path = tmp_path / "p.bin"
    path.write_bytes(payload)
    with open(path, "rb") as fh:
        mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ)
        outs = [decode(mm), decode(bytearray(payload)), decode(memoryview(payload))]
        assert sha256_hex(mm) == sha256_hex(payload)
        assert torch.equal(decode_tensor(mm, "a"), ref["a"])
        packed = read_bitdelta(mm, "a")
        mm.close()  # raises BufferError if the codec kept a view into the mapping
    assert torch.equal(packed.to_dense(), ref["a"])
    for out in outs:
        assert all(torch.equal(out[k], ref[k]) for k in ref)
    assert read_manifest(payload).metadata == {"round": 3, "note": "x"}


def test_sha256_hex_matches_hashlib():
    import hashlib

    assert sha256_hex(b"abc") == hashlib.sha256(b"abc").hexdigest()


def test_payload_is_deterministic_and_size_is_as_computed():
    x = _randn((64, 256), seed=13)
    p1, p2 = encode({"x": x}, group_size=128), encode({"x": x}, group_size=128)
    assert p1 == p2
    e = read_manifest(p1).entries[0]
    assert e.nbytes == 64 * 256 // 8 + 4 + 64 * 2  # signs + log8 (float32 reference + 1 byte per group)
    f = read_manifest(encode({"x": x}, group_size=128, scale_dtype="float32")).entries[0]
    assert f.nbytes == 64 * 256 // 8 + 64 * 2 * 4  # signs + float32 scales
    assert math.isclose(np.float32(1.0), 1.0)


def test_fp16_lora_factors_keep_a_fresh_lora_b_in_range():
    # Prepare: a LoRA a few steps in: A ~ 1e-1, B ~ 2e-5, mostly below float16's normal range (6.1e-5)
    from zoo_gym import codec
    from zoo_gym.codec.lora import LoraFactors

    g = torch.Generator().manual_seed(0)
    f = LoraFactors(A=torch.randn(8, 1024, generator=g) / 8 ** 0.5, B=torch.randn(3072, 8, generator=g) * 2e-5)
    # Execute
    back = codec.decode_factors(codec.encode({"w": f}, codec="lora", lora_codec="fp16"), "w")
    # Assert: the merged delta keeps float16's precision (casting the factors as they were lost 8.9e-4)
    exact = f.merged().double()
    assert float((back.merged().double() - exact).norm() / exact.norm()) < 4e-4
