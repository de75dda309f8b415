"""Byzantine delta generators: exact values on a hand-made honest stack."""

from __future__ import annotations

import pytest
import torch

from benchmarks import attacks

H = torch.tensor([[1.0, 2.0], [3.0, 2.0]])  # mean (2, 2), population std (1, 0)


def test_deterministic_attacks():
    g = torch.Generator().manual_seed(0)
    assert attacks.sign_flip(H, n_byzantine=2, generator=g).tolist() == [[-2.0, -2.0]] * 2
    assert attacks.scaling(H, n_byzantine=1, boost=10.0).tolist() == [[20.0, 20.0]]
    assert attacks.ipm(H, n_byzantine=1, epsilon=0.5).tolist() == [[-1.0, -1.0]]
    assert attacks.alie(H, n_byzantine=1, z=1.5).tolist() == [[0.5, 2.0]]
    assert attacks.free_rider_zero(H, n_byzantine=1).tolist() == [[0.0, 0.0]]
    assert torch.equal(H, torch.tensor([[1.0, 2.0], [3.0, 2.0]]))


def test_alie_z_from_paper_and_random_attacks_seeded():
    # n = 50, f = 24: s = floor(26) - 24 = 2, z = Phi^-1(48/50) = 1.7507
    assert attacks.alie_z(n=50, n_byzantine=24) == pytest.approx(1.7507, abs=1e-4)
    a = attacks.gaussian(H, n_byzantine=3, sigma=2.0, generator=torch.Generator().manual_seed(1))
    b = attacks.gaussian(H, n_byzantine=3, sigma=2.0, generator=torch.Generator().manual_seed(1))
    assert a.shape == (3, 2) and torch.equal(a, b)
    r = attacks.free_rider_random(H, n_byzantine=2, generator=torch.Generator().manual_seed(2))
    assert r.shape == (2, 2) and not torch.equal(r, torch.zeros(2, 2))
