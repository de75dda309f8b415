"""Range decode (issue 50): rows of a dense codec's tensor decoded from those rows' bytes alone are the numbers
the whole decode gives; where they cannot be (bitdelta, lora, int4 rows off a byte) the answer is None, and a range
outside the tensor or a corrupt row is a CodecError."""

from __future__ import annotations

import pytest
import torch

from zoo_gym import codec
from zoo_gym.codec import CodecError, LoraFactors

CASES = [("fp32", None, torch.float32), ("fp16", None, torch.float32), ("bf16", None, torch.bfloat16),
         ("fp16", None, torch.float16), ("int8", None, torch.float32), ("int8", 16, torch.float32),
         ("int8", -1, torch.float32), ("int4", 16, torch.float32), ("int4", None, torch.bfloat16)]


@pytest.mark.parametrize("method,group,dtype", CASES, ids=[f"{m}-{g}-{d}".replace("torch.", "") for m, g, d in CASES])
@pytest.mark.parametrize("shape", [(37, 40), (12, 3, 7)], ids=["2d", "3d"])
def test_rows_decode_to_the_whole_decodes_numbers(method, group, dtype, shape):
    x = (torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 1e-2).to(dtype)
    payload = codec.encode({"w": x}, codec=method, group_size=group)
    whole = codec.decode_tensor(payload, "w").reshape(shape[0], -1)
    for r0, r1 in ((0, shape[0]), (0, 1), (2, 9), (shape[0] - 3, shape[0]), (5, 5)):
        got = codec.decode_rows(payload, "w", r0, r1)
        if got is None:  # only int4 with rows of an odd number of codes that start off a byte
            assert method == "int4" and ((r0 * whole.shape[1]) % 2 or ((r1 - r0) * whole.shape[1]) % 2)
            continue
        assert got.dtype == whole.dtype and torch.equal(got, whole[r0:r1]), (r0, r1)


def test_codecs_with_their_own_row_paths_and_bad_ranges():
    x = torch.randn(8, 16)
    assert codec.decode_rows(codec.encode({"w": x}, codec="bitdelta"), "w", 0, 4) is None
    lora = codec.encode({"w": LoraFactors(A=torch.randn(2, 16), B=torch.randn(8, 2))}, codec="lora")
    assert codec.decode_rows(lora, "w", 0, 4) is None
    with pytest.raises(CodecError, match=r"rows \[4, 9\) are outside its 8 rows"):
        codec.decode_rows(codec.encode({"w": x}, codec="fp16"), "w", 4, 9)


def test_a_corrupt_row_in_the_range_is_refused():
    x = torch.randn(8, 16)
    payload = bytearray(codec.encode({"w": x}, codec="fp32"))
    e = codec.read_manifest(bytes(payload)).entry("w")
    at = e.offset + 4 * 16 * 5  # row 5, column 0: a float32 NaN
    payload[at:at + 4] = bytes.fromhex("0000c07f")
    assert torch.equal(codec.decode_rows(bytes(payload), "w", 0, 5), x[:5])  # rows before it are intact
    with pytest.raises(CodecError, match="NaN or inf"):
        codec.decode_rows(bytes(payload), "w", 4, 6)
