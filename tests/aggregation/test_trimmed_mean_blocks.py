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


@pytest.mark.parametrize("n", [7, 50])
@pytest.mark.parametrize("weighted", [False, True])
def test_both_sorts_give_the_same_bits_with_ties(monkeypatch, n, weighted):
    """Columns sorted where they lie or made contiguous first (TRANSPOSE_FROM): the same kept values from the same
    rows, so the same aggregate and diagnostics, ties included (values on a coarse grid: which of two equal
    values is kept decides whose weight counts)."""
    g = torch.Generator().manual_seed(n)
    x = torch.randint(-3, 4, (n, 501), generator=g).float() * 0.25
    w = torch.rand(n, generator=g) + 0.1 if weighted else None
    monkeypatch.setattr(tm, "TRANSPOSE_FROM", 10 ** 9)
    in_place = tm.trimmed_mean(x, beta=0.4, weights=w)
    monkeypatch.setattr(tm, "TRANSPOSE_FROM", 1)
    contiguous = tm.trimmed_mean(x, beta=0.4, weights=w)
    assert torch.equal(in_place.aggregate, contiguous.aggregate)
    for field in ("selected", "weight_used", "trimmed_share"):
        assert torch.equal(getattr(in_place.diagnostics, field), getattr(contiguous.diagnostics, field)), field
