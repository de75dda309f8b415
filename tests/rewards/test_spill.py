"""The spilled gradient reads back exactly what was put, whatever the sizes, across the O_DIRECT
writer's buffers (zoo_gym/direct_writes.py) and after reads have begun."""

from __future__ import annotations

import torch

from zoo_gym import direct_writes
from zoo_gym.rewards.spill import SpilledTensors


def test_spilled_tensors_read_back_exactly(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(direct_writes, "BUFFER", 64 << 10)
    g = torch.Generator().manual_seed(0)
    shapes = [(3,), (1000, 17), (64 << 8,), (5, 7, 11), (70_001,), (1,)]
    want = {f"t{i}": torch.randn(s, generator=g) for i, s in enumerate(shapes)}
    want["half"] = torch.randn(33_333, generator=g).to(torch.bfloat16)
    spill = SpilledTensors(tmp_path)
    for name, t in want.items():
        spill.put(name, t)
        spill.alias(name, name, t.shape, t.dtype)
    assert torch.equal(spill["t1"], want["t1"])  # a read while the last buffer is still in memory
    late = torch.randn(40_000, generator=g)
    spill.put("late", late)  # a put after reads began
    spill.alias("late", "late", late.shape, late.dtype)
    spill.alias("tied", "t4", want["t4"].shape, want["t4"].dtype)
    for name, t in want.items():
        assert torch.equal(spill[name], t), name
    assert torch.equal(spill["late"], late)
    assert torch.equal(spill["tied"], want["t4"])
    spill.close()
    assert spill["t0"].is_meta
