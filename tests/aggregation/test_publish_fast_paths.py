"""The publish step's fast paths give the slow obvious references' very numbers (STYLE 14): StoredDeltas
decodes LoRA factors straight into its stacked rows, `combine` works a chunk of columns at a time, and
the checkpoint writer's output threads report an output's failure to the caller."""

import pytest
import torch

from zoo_gym import codec
from zoo_gym.aggregation import _checks
from zoo_gym.aggregation._checks import combine, combine64
from zoo_gym.codec.lora import LoraFactors
from zoo_gym.server.store.checkpoint_writer import _Background
from zoo_gym.server.rounds.publish import StoredDeltas

SHAPES = {"a.weight": (48, 32), "b.weight": (32, 64), "c.weight": (16, 16), "norm.weight": (32,)}


def _payloads() -> list[bytes]:
    g = torch.Generator().manual_seed(0)
    lora = {k: LoraFactors(A=torch.randn(4, s[1], generator=g), B=torch.randn(s[0], 4, generator=g) * 1e-3)
            for k, s in SHAPES.items() if len(s) == 2 and k != "c.weight"}
    first = codec.encode({**lora, "c.weight": torch.randn(16, 16, generator=g)}, codec="lora", lora_codec="fp32")
    second = codec.encode({"a.weight": lora["a.weight"], "norm.weight": torch.randn(32, generator=g)},
                          codec="lora", lora_codec="bf16")  # bf16 factors: decoded by the general path
    return [first, second]


def test_stacked_rows_equal_decoded_tensors():
    # Prepare: fp32 LoRA factors, a dense tensor, bf16 factors, and tensors one contributor left out
    payloads = _payloads()
    stored = StoredDeltas(payloads, ["x", "y"], SHAPES, cache_bytes=0)
    for name in stored.names():
        # Execute
        rows = stored.stacked(name)
        # Assert: row i is contributor i's decoded tensor, bit for bit (zeros when it did not send it)
        for i, payload in enumerate(payloads):
            sent = name in codec.read_manifest(payload).names
            want = (codec.decode_tensor(payload, name).reshape(-1).float() if sent
                    else torch.zeros(rows.shape[1]))
            assert torch.equal(rows[i], want), (name, i)
    assert any(not bool((r == 0).all()) for r in stored.stacked("a.weight"))  # the test can fail


def test_merged_into_a_buffer_equals_merged():
    f = LoraFactors(A=torch.randn(8, 96), B=torch.randn(80, 8) * 2e-5)
    buf = torch.empty(2, 80 * 96)
    f.merged(out=buf[1].view(80, 96))
    assert torch.equal(buf[1].view(80, 96), f.merged())


@pytest.mark.parametrize("weights,total", [([1.0, 1.0, 1.0], None), ([0.2, 0.5, 0.3], None), ([1.0, 1.0, 1.0], 5.0),
                                           ([0.0, 1.0, 1.0], None), ([0.0, 0.7, 1.0], 3.0)])
def test_chunked_combine_equals_combine64(monkeypatch, weights, total):
    # Prepare: values over 60 orders of magnitude (float64 rounding matters), chunks smaller than a row
    monkeypatch.setattr(_checks, "_COMBINE_CHUNK", 1000)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 4321, generator=g) * torch.logspace(-30, 30, 4321).float()
    w = torch.tensor(weights, dtype=torch.float64)
    # Execute / Assert: the same float32 bits as the whole-vector float64 reference
    got, want = combine(w, x, total=total), combine64(w, x, total=total).to(torch.float32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def test_background_output_error_reaches_the_caller():
    written = []

    def output(data):
        if data == b"bad":
            raise OSError("disk full")
        written.append(bytes(data))

    bg = _Background([output], name="test")
    try:
        bg(b"one")
        bg(b"bad")
        with pytest.raises(OSError, match="disk full"):
            bg.drain()
        with pytest.raises(OSError, match="disk full"):
            bg(b"two")
    finally:
        bg.close()
    assert written == [b"one"]
