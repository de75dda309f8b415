"""Hostile payloads: every truncation, every header corruption and every inconsistency raises CodecError."""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from zoo_gym.codec import (CodecError, LoraFactors, decode, decode_factors, decode_tensor, encode, read_bitdelta,
                           read_manifest)
from zoo_gym.codec.container import BODY_ALIGN

_PREFIX = struct.Struct("<8sHHII")


def _delta():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(6, 21, generator=g),
        "b": torch.randn(21, generator=g),
        "l": LoraFactors(torch.randn(2, 9, generator=g), torch.randn(5, 2, generator=g)),
    }


PAYLOADS = {
    "bitdelta": encode(_delta(), codec="bitdelta", group_size=8, scale_dtype="float32"),  # log8: test_codec_log8
    "int8": encode(_delta(), codec="int8", group_size=8),
    "int4": encode(_delta(), codec="int4", group_size=None),
    "lora": encode(_delta(), codec="lora", lora_codec="bitdelta", group_size=-1),
}


def _split(payload: bytes):
    magic, version, flags, hlen, crc = _PREFIX.unpack_from(payload, 0)
    header = json.loads(payload[_PREFIX.size : _PREFIX.size + hlen])
    body_start = -(-(_PREFIX.size + hlen) // BODY_ALIGN) * BODY_ALIGN
    return header, payload[body_start:]


def _seal(header: dict, body: bytes) -> bytes:
    """Rebuild a payload around an edited header with a VALID checksum: only field validation can catch it."""
    hb = json.dumps(header).encode()
    head = _PREFIX.pack(b"ZGDELTA\x00", 1, 0, len(hb), zlib.crc32(hb)) + hb
    return head + bytes(-len(head) % BODY_ALIGN) + body


def test_resealing_an_unchanged_header_still_decodes():
    header, body = _split(PAYLOADS["bitdelta"])
    out = decode(_seal(header, body))
    assert torch.equal(out["w"], decode(PAYLOADS["bitdelta"])["w"])


@pytest.mark.parametrize("kind", sorted(PAYLOADS))
def test_every_prefix_truncation_raises(kind):
    payload = PAYLOADS[kind]
    for n in range(len(payload)):
        with pytest.raises(CodecError):
            decode(payload[:n])
    with pytest.raises(CodecError, match="trailing"):
        decode(payload + b"\x00")


@settings(max_examples=150, deadline=None)
@given(kind=st.sampled_from(sorted(PAYLOADS)), data=st.data())
def test_random_header_corruption_raises(kind, data):
    payload = bytearray(PAYLOADS[kind])
    _, _, _, hlen, _ = _PREFIX.unpack_from(payload, 0)
    body_start = -(-(_PREFIX.size + hlen) // BODY_ALIGN) * BODY_ALIGN
    positions = data.draw(st.lists(st.integers(0, body_start - 1), min_size=1, max_size=4, unique=True))
    for pos in positions:
        payload[pos] ^= data.draw(st.integers(1, 255))
    with pytest.raises(CodecError):
        decode(payload)
    with pytest.raises(CodecError):
        read_manifest(payload)


def _edit(kind, fn):
    header, body = _split(PAYLOADS[kind])
    fn(header)
    return _seal(header, body)


EDITS = {
    "nbytes too small": (lambda h: h["entries"][0].update(nbytes=h["entries"][0]["nbytes"] - 1), "nbytes"),
    "offset past body": (lambda h: h["entries"][0].update(offset=h["body_size"] - 8), "run past the body"),
    "overlap": (lambda h: h["entries"][1].update(offset=h["entries"][0]["offset"]), "overlap"),
    "unknown codec": (lambda h: h["entries"][0].update(codec="int3"), "unknown codec"),
    "unknown dtype": (lambda h: h["entries"][0].update(dtype="float64"), "unknown dtype"),
    "duplicate name": (lambda h: h["entries"][1].update(name="w"), "appears twice"),
    "empty name": (lambda h: h["entries"][0].update(name=""), "non-empty"),
    "bool as int": (lambda h: h["entries"][0].update(offset=False), "offset"),
    "negative dim": (lambda h: h["entries"][0].update(shape=[-6, 21]), "shape"),
    "zero dim": (lambda h: h["entries"][0].update(shape=[0, 21]), "shape"),
    "huge shape": (lambda h: h["entries"][0].update(shape=[2**40, 2**40]), "max_elements"),
    "too many dims": (lambda h: h["entries"][0].update(shape=[1] * 9), "shape"),
    "bitdelta group not /8": (lambda h: h["entries"][0].update(group_size=12), "multiple of 8"),
    "group_size zero": (lambda h: h["entries"][0].update(group_size=0), "group_size"),
    "bad scale dtype": (lambda h: h["entries"][0].update(scale_dtype="float8"), "scale_dtype"),
    "extra key": (lambda h: h["entries"][0].update(evil=1), "expected keys"),
    "body_size": (lambda h: h.update(body_size=h["body_size"] - 64), "declares"),
    "entries not list": (lambda h: h.update(entries={"w": 1}), "entries"),
    "metadata not dict": (lambda h: h.update(metadata=[1]), "metadata"),
}


@pytest.mark.parametrize("name", sorted(EDITS))
def test_inconsistent_headers_with_valid_checksum_raise_with_a_reason(name):
    fn, match = EDITS[name]
    payload = _edit("bitdelta", fn)
    with pytest.raises(CodecError, match=match):
        decode(payload)


LORA_EDITS = {
    "rank mismatch": (lambda h: h["entries"][2].update(rank=3), "factors must be"),
    "merged shape too big": (lambda h: h["entries"][2].update(shape=[2**31, 9]), "max_elements"),
    "factor name": (lambda h: h["entries"][2]["factors"][0].update(name="B"), "factors must be"),
    "span": (lambda h: h["entries"][2].update(nbytes=h["entries"][2]["nbytes"] + 64), "span"),
}


@pytest.mark.parametrize("name", sorted(LORA_EDITS))
def test_inconsistent_lora_entries_raise(name):
    fn, match = LORA_EDITS[name]
    with pytest.raises(CodecError, match=match):
        decode(_edit("lora", fn))


def test_max_elements_bounds_what_decode_allocates():
    payload = encode({"x": torch.ones(100, 100)}, codec="fp16")
    assert decode(payload, max_elements=10_000)["x"].shape == (100, 100)
    with pytest.raises(CodecError, match="max_elements"):
        decode(payload, max_elements=9_999)


def test_a_model_past_two_billion_elements_is_read_tensor_by_tensor_but_never_decoded_whole():
    """A 4B model's LoRA delta covers 3.6e9 weights: its manifest and each tensor read (the server streams
    them one at a time), while a whole `decode()`, which would allocate all of them, is still refused."""
    g = torch.Generator().manual_seed(0)
    big = {f"l{i}.weight": LoraFactors(A=torch.randn(1, 40_000, generator=g), B=torch.randn(40_000, 1, generator=g))
           for i in range(2)}  # 2 x 1.6e9 merged elements, 320 kB of factors
    payload = encode(big, codec="lora")
    assert sum(e.numel for e in read_manifest(payload).entries) == 3_200_000_000 > 2**31
    f, want = decode_factors(payload, "l1.weight"), big["l1.weight"]
    assert torch.allclose(f.B[:5].float() @ f.A[:, :5].float(), want.B[:5] @ want.A[:, :5], rtol=1e-2, atol=1e-3)
    with pytest.raises(CodecError, match="in total"):
        decode(payload)
    with pytest.raises(CodecError, match="max_total_elements"):
        read_manifest(payload, max_total_elements=2**31)


def _body_edit(kind: str, name: str, fn) -> bytes:
    payload = bytearray(PAYLOADS[kind])
    e = read_manifest(bytes(payload)).entry(name)
    fn(payload, e)
    return bytes(payload)


def test_non_finite_or_negative_scales_raise():
    def nan_scale(p, e):  # bitdelta "w": signs 6 rows x 3 bytes = 18 -> scales at 24
        p[e.offset + 24 : e.offset + 28] = np.float32(np.nan).tobytes()

    def neg_scale(p, e):
        p[e.offset + 24 : e.offset + 28] = np.float32(-1.0).tobytes()

    for fn in (nan_scale, neg_scale):
        bad = _body_edit("bitdelta", "w", fn)
        with pytest.raises(CodecError, match="scales must be finite and >= 0"):
            decode(bad)
        with pytest.raises(CodecError, match="scales"):
            read_bitdelta(bad, "w")


def test_nonzero_padding_bits_raise():
    def pad(p, e):  # 21 columns -> byte 2 of row 0 holds bits 16..20; bit 7 is padding
        p[e.offset + 2] |= 0x80

    with pytest.raises(CodecError, match="padding bits"):
        decode_tensor(_body_edit("bitdelta", "w", pad), "w")


def test_integer_codes_never_written_raise():
    def int8_min(p, e):
        p[e.offset] = 0x80  # -128

    def int4_zero(p, e):
        p[e.offset] &= 0xF0  # low nibble 0 -> code -8

    with pytest.raises(CodecError, match="-128"):
        decode(_body_edit("int8", "w", int8_min))
    with pytest.raises(CodecError, match="-8"):
        decode(_body_edit("int4", "w", int4_zero))


def test_non_finite_passthrough_values_raise():
    def inf(p, e):
        p[e.offset : e.offset + 2] = np.float16(np.inf).tobytes()

    with pytest.raises(CodecError, match="NaN or inf"):
        decode(_body_edit("bitdelta", "b", inf))


@pytest.mark.parametrize("junk", [b"", b"ZGDELTA", b"\x00" * 100, "text", 12, [1, 2]])
def test_junk_inputs_raise(junk):
    with pytest.raises(CodecError):
        decode(junk)


def test_encode_rejects_bad_input_with_a_reason():
    with pytest.raises(CodecError, match="NaN or inf"):
        encode({"x": torch.tensor([[1.0, float("nan")] * 4])})
    with pytest.raises(CodecError, match="NaN or inf"):
        encode({"x": torch.tensor([[1.0, float("inf")]])}, codec="int8")
    with pytest.raises(CodecError, match="float64"):
        encode({"x": torch.ones(2, 2, dtype=torch.float64)})
    with pytest.raises(CodecError, match="codec"):
        encode({"x": torch.ones(2, 2)}, codec="zip")
    with pytest.raises(CodecError, match="multiple of 8"):
        encode({"x": torch.ones(2, 64)}, group_size=12)
    with pytest.raises(CodecError, match="empty"):
        encode({"x": torch.ones(0, 3)})
    with pytest.raises(CodecError, match="range of fp16"):
        encode({"x": torch.full((2, 2), 1e6)}, codec="fp16")
    with pytest.raises(CodecError, match="metadata"):
        encode({"x": torch.ones(2, 2)}, metadata={"x": float("nan")})
    with pytest.raises(CodecError, match="rank"):
        LoraFactors(torch.ones(2, 3), torch.ones(4, 3))
