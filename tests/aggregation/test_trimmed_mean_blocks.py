"""The trimmed mean sorts a column block at a time (issue 51: its sort was 12 bytes x contributors x the tensor's
elements at once); the aggregate and every diagnostic are the same numbers, bit for bit, whatever the block."""

import importlib

import pytest
import torch

tm = importlib.import_module("zoo_gym.aggregation.trimmed_mean")


@pytest.mark.parametrize("n,d", [(7, 1000), (50, 3001), (301, 777)])
@pytest.mark.parametrize("weighted", [False, True])
def test_column_blocks_give_the_same_bits(monkeypatch, n, d, weighted):
    g = torch.Generator().manual_seed(n)
    x, w = torch.randn(n, d, generator=g), torch.rand(n, generator=g) if weighted else None
    whole = tm.trimmed_mean(x, beta=0.4, weights=w)
    for columns in (1, 7, d - 1):
        monkeypatch.setattr(tm, "SORT_BYTES", 12 * n * columns)
        part = tm.trimmed_mean(x, beta=0.4, weights=w)
        assert torch.equal(part.aggregate, whole.aggregate)
        for field in ("selected", "weight_used", "trimmed_share"):
            assert torch.equal(getattr(part.diagnostics, field), getattr(whole.diagnostics, field)), field
