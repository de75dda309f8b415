"""The publish's fused bf16 master update gives the torch definition's bits (master_weights.py), and the
streamed blob writer and reader move the same bytes as the plain ones."""

from __future__ import annotations

import hashlib

import pytest
import torch

from zoo_gym.io import page_cache
from zoo_gym.server.store.blobs import BlobStore
from zoo_gym.io.safetensors_reader import SafetensorsReader
from zoo_gym.server.store.checkpoint_writer import threads_beside_writers
from zoo_gym.server.store.master_kernel import add_to_bf16_master
from zoo_gym.server.store.master_weights import join_low16, split_low16


def _hard_masters() -> torch.Tensor:
    """float32 masters: random weights, exact bf16 ties both ways, zeros, subnormals, values near the top."""
    gen = torch.Generator().manual_seed(0)
    m = torch.randn(1 << 18, generator=gen) * 0.02
    ties = torch.tensor([1.0, 1.0, -1.0, -1.0]).view(torch.int32) + torch.tensor(
        [0x8000, 0x18000, 0x8000, 0x18000], dtype=torch.int32)  # rounded down, up, down, up
    special = torch.tensor([0.0, -0.0, 1e-40, -1e-40, 3.0e38, -3.0e38, 3.38e38])
    return torch.cat([m, ties.view(torch.float32), special])


@pytest.mark.parametrize("threads", [1, 2])
def test_fused_update_equals_join_add_split_bit_for_bit(threads):
    # Prepare: a stored master (bf16 + low half) and aggregates: small ones, ones that land on ties, ones
    # that overflow to infinity
    master = _hard_masters()
    published, low = split_low16(master)
    gen = torch.Generator().manual_seed(1)
    agg = torch.randn(master.shape, generator=gen) * 1e-5
    agg[-3:] = torch.tensor([3.0e38, -3.0e38, 3.0e38])  # to +inf, to -inf, to +inf
    want_p, want_l = split_low16(join_low16(published, low) + agg)
    # Execute
    got_p, got_l = add_to_bf16_master(published.clone(), low.clone(), agg, threads=threads)
    # Assert: identical bits, infinities included
    assert torch.equal(got_p.view(torch.int16), want_p.view(torch.int16))
    assert torch.equal(got_l, want_l)
    assert torch.isinf(got_p[-3:].float()).all()


def test_fused_update_without_a_stored_master_starts_from_the_published_weights():
    published = _hard_masters()[:-3].to(torch.bfloat16)
    agg = torch.randn(published.shape, generator=torch.Generator().manual_seed(2)) * 3e-5
    got_p, got_l = add_to_bf16_master(published.clone(), None, agg)
    want_p, want_l = split_low16(published.float() + agg)
    assert torch.equal(got_p.view(torch.int16), want_p.view(torch.int16)) and torch.equal(got_l, want_l)
    assert not torch.equal(got_p, published)  # the update moved the weights


def test_fused_update_turns_nan_into_torchs_quiet_nan():
    published, low = split_low16(torch.tensor([0.5, 0.25]))
    got_p, _ = add_to_bf16_master(published.clone(), low.clone(), torch.tensor([float("nan"), 0.0]))
    assert got_p.view(torch.int16)[0].item() == 0x7FC0 and got_p[1].item() == 0.25


def test_fused_update_refuses_mismatched_inputs():
    with pytest.raises(ValueError, match="float32 aggregate of its size"):
        add_to_bf16_master(torch.zeros(4, dtype=torch.bfloat16), None, torch.zeros(3))
    with pytest.raises(ValueError, match="int16"):
        add_to_bf16_master(torch.zeros(4, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.int32), torch.zeros(4))


def test_streamed_blob_has_the_same_bytes_and_name_as_a_plain_one(tmp_path, monkeypatch):
    # Prepare: a small drop step, so a few MB cross it many times (and at uneven piece sizes)
    monkeypatch.setattr(page_cache, "DROP_STEP", 1 << 16)
    store = BlobStore(tmp_path / "store")
    data = torch.randint(0, 256, (3 << 20,), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    raw = bytes(data.numpy())
    pieces = [raw[i:i + 40_000] for i in range(0, len(raw), 40_000)]
    # Execute
    with store.writer(streamed=True) as w:
        for p in pieces:
            w.write(memoryview(p))
        sha = w.commit()
    # Assert
    assert sha == hashlib.sha256(raw).hexdigest()
    assert store.path(sha).read_bytes() == raw


def test_streamed_reader_reads_the_same_tensors(tmp_path):
    from safetensors.torch import save_file

    ts = {"a": torch.randn(300, 70), "b": torch.randn(5).to(torch.bfloat16)}
    save_file(ts, str(tmp_path / "m.safetensors"))
    with SafetensorsReader(tmp_path / "m.safetensors", streamed=True) as r:
        assert torch.equal(r.read("a"), ts["a"]) and torch.equal(r.read("b"), ts["b"])
        assert b"".join(r.chunks("a")) == bytes(ts["a"].numpy().tobytes())


def test_threads_beside_writers_leaves_the_writers_their_cores_and_restores():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        with threads_beside_writers():
            assert torch.get_num_threads() == 2
        assert torch.get_num_threads() == 4
        torch.set_num_threads(1)
        with threads_beside_writers():
            assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
