"""linear_shapley samples its permutations a block at a time (issue 51: all 2048 at once were ~8 float64 (2048, n)
temporaries, 1.3 GB at n = 10,000): the same draws and sums, so the same values bit for bit, whatever the block."""

import importlib

import pytest
import torch

fo = importlib.import_module("zoo_gym.rewards.first_order")


@pytest.mark.parametrize("n", [3, 6, 7, 50, 300])
def test_blocks_of_permutations_give_the_same_values(monkeypatch, n):
    g = torch.Generator().manual_seed(n)
    gains, weights = torch.randn(n, generator=g).tolist(), torch.rand(n, generator=g).tolist()
    whole = fo.linear_shapley(gains, weights, permutations=2048, generator=torch.Generator().manual_seed(9))
    for per_block in (1, 5, 333):
        monkeypatch.setattr(fo, "SHAPLEY_BYTES", 64 * n * per_block)
        assert fo.linear_shapley(gains, weights, permutations=2048,
                                 generator=torch.Generator().manual_seed(9)) == whole
