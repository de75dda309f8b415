"""The spilled gradient reads back what was put, whatever the sizes, across the O_DIRECT writer's buffers
(zoo_gym/io/direct_writes.py) and after reads have begun: exactly without narrowing, and float32 rounded to
bfloat16 by default (half the disk). ReadAhead hands out the same tensors, in or out of its order."""

from __future__ import annotations

import pytest
import torch

from zoo_gym.io import direct_writes
from zoo_gym.evaluation.spill import SpilledTensors, read_ahead


def _expected(t: torch.Tensor, stored: torch.dtype | None) -> torch.Tensor:
    return t if stored is None or t.dtype == torch.bfloat16 else t.to(stored).to(t.dtype)


@pytest.mark.parametrize("stored", [None, torch.bfloat16])
def test_spilled_tensors_read_back(tmp_path, monkeypatch, stored) -> None:
    monkeypatch.setattr(direct_writes, "BUFFER", 64 << 10)
    g = torch.Generator().manual_seed(0)
    shapes = [(3,), (1000, 17), (64 << 8,), (5, 7, 11), (70_001,), (1,)]
    want = {f"t{i}": torch.randn(s, generator=g) for i, s in enumerate(shapes)}
    want["half"] = torch.randn(33_333, generator=g).to(torch.bfloat16)
    spill = SpilledTensors(tmp_path, stored_dtype=stored)
    for name, t in want.items():
        spill.put(name, t)
        spill.alias(name, name, t.shape, t.dtype)
    assert torch.equal(spill["t1"], _expected(want["t1"], stored))  # a read while the last buffer is in memory
    late = torch.randn(40_000, generator=g)
    spill.put("late", late)  # a put after reads began
    spill.alias("late", "late", late.shape, late.dtype)
    spill.alias("tied", "t4", want["t4"].shape, want["t4"].dtype)
    for name, t in want.items():
        got = spill[name]
        assert got.dtype == t.dtype and torch.equal(got, _expected(t, stored)), name
        if t.dtype == torch.float32:
            assert spill.stored(name).dtype == (stored or torch.float32)
    assert torch.equal(spill["late"], _expected(late, stored))
    assert torch.equal(spill["tied"], _expected(want["t4"], stored))
    assert "tied" in spill and "absent" not in spill
    if stored is not None:  # what narrowing saves: the float32 tensors take half the bytes
        assert spill.stored_nbytes("t1") == 2 * want["t1"].numel()
        assert not torch.equal(spill["t1"], want["t1"])
    spill.close()
    assert spill["t0"].is_meta


def test_blocks_are_narrowed_like_whole_tensors(tmp_path) -> None:
    spill = SpilledTensors(tmp_path)
    w = torch.randn(10, 6, generator=torch.Generator().manual_seed(1))
    spill.put_blocks("w", w.shape, [w[:4], w[4:]])
    spill.alias("w", "w", w.shape, w.dtype)
    assert torch.equal(spill["w"], w.to(torch.bfloat16).float())
    assert spill.stored("w").dtype == torch.bfloat16


def test_read_ahead_hands_out_the_stored_tensors_in_and_out_of_order(tmp_path) -> None:
    g = torch.Generator().manual_seed(2)
    spill = SpilledTensors(tmp_path)
    tensors = {f"t{i}": torch.randn(1000 * (i + 1), generator=g) for i in range(5)}
    for name, t in tensors.items():
        spill.put(name, t)
        spill.alias(name, name, t.shape, t.dtype)
    order = list(tensors)
    reader = read_ahead(spill, order, max_bytes=2 * 3500)  # t3 and t4 are too big to read ahead
    asked = ["t0", "t1", "t3", "t2", "t4", "t0"]  # t3 out of order, t0 twice
    for name in asked:
        got = reader.get(name)
        assert got.dtype == torch.bfloat16 and torch.equal(got, tensors[name].to(torch.bfloat16)), name
    assert reader.read_ahead == 2  # t0 and t1; t2's read was dropped when t3 came first, t3 and t4 are too big
    reader.close()
    spill.close()
