"""Accountant equals Opacus exactly; clipping handles zero; adaptive clip moves the right way."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st
from opacus.accountants import RDPAccountant

from zoo_gym.aggregation import PrivacyAccountant, clip_factors
from zoo_gym.aggregation.clipping import adaptive_clip_update, update_noise_multiplier
from zoo_gym.aggregation.privacy import gaussian_noise


def test_accountant_equals_opacus_exactly():
    ours, ref = PrivacyAccountant(), RDPAccountant()
    for _ in range(100):
        ours.step(noise_multiplier=1.0, sample_rate=0.1)
        ref.step(noise_multiplier=1.0, sample_rate=0.1)
    assert ours.history == [(1.0, 0.1, 100)]
    assert ours.epsilon_rdp(delta=1e-5) == ref.get_epsilon(delta=1e-5)  # the cross-check; PRV: test_accountant.py
    assert ours.epsilon_rdp(delta=1e-5) == pytest.approx(7.899, abs=1e-3)  # FINDINGS.md figure
    again = PrivacyAccountant(history=ours.history)
    assert again.epsilon_rdp(delta=1e-5) == ours.epsilon_rdp(delta=1e-5)


@settings(max_examples=2, deadline=None)
@given(z=st.floats(0.5, 3.0), q=st.floats(0.01, 1.0), steps=st.integers(1, 30))
def test_epsilon_if_step_equals_stepping_and_never_decreases(z, q, steps):
    acct = PrivacyAccountant(history=[(z, q, steps)])
    before = acct.epsilon(delta=1e-5)
    predicted = acct.epsilon_if_step(noise_multiplier=z, sample_rate=q, delta=1e-5)
    acct.step(noise_multiplier=z, sample_rate=q)
    assert acct.epsilon(delta=1e-5) == predicted >= before


def test_clip_factors_zero_and_large():
    f = clip_factors(torch.tensor([0.0, 0.25, 2.0]), max_norm=0.5)
    assert f.tolist() == [1.0, 1.0, 0.25]


def test_adaptive_clip_moves_toward_target_quantile():
    g = torch.Generator().manual_seed(0)
    norms = torch.full((100,), 10.0)
    up = adaptive_clip_update(norms, clip=1.0, target_quantile=0.5, lr=0.2, count_stddev=1e-9,
                              expected_contributors=100, generator=g)
    assert up == pytest.approx(1.0 * 2.718281828 ** (0.2 * 0.5))  # all clipped: b = 0 -> grow
    down = adaptive_clip_update(torch.full((100,), 0.1), clip=1.0, target_quantile=0.5, lr=0.2,
                                count_stddev=1e-9, expected_contributors=100, generator=g)
    assert down < 1.0  # none clipped: b = 1 -> shrink
    # Andrew et al.: total noise stays z
    z_delta = update_noise_multiplier(noise_multiplier=1.0, count_stddev=5.0)
    assert (z_delta ** -2 + (2 * 5.0) ** -2) ** -0.5 == pytest.approx(1.0)


def test_noise_std_secure_and_seeded():
    g = torch.Generator().manual_seed(3)
    a = gaussian_noise((200_000,), std=2.0, generator=g)
    assert a.std().item() == pytest.approx(2.0, rel=0.01)
    b = gaussian_noise((200_000,), std=2.0, generator=torch.Generator().manual_seed(3), secure=True)
    assert b.std().item() == pytest.approx(2.0, rel=0.01)
    assert torch.equal(gaussian_noise((5,), std=1.0, generator=torch.Generator().manual_seed(1)),
                       gaussian_noise((5,), std=1.0, generator=torch.Generator().manual_seed(1)))


def test_the_dp_step_reads_each_setting_under_the_flags_name():
    # issue 49: the dp_* settings were copied onto DifferentialPrivacy under other names (dp_noise_multiplier ->
    # noise_multiplier, dp_secure_noise -> secure, ...); it now reads the config's fields where they are used
    from zoo_gym.aggregation import DeltaSoup, SoupConfig

    cfg = SoupConfig(aggregator="mean", dp_noise_multiplier=0.8, dp_clip=2.0, dp_expected_contributors=4)
    dp = DeltaSoup(cfg).dp
    assert dp.config is cfg and dp.clip == 2.0 and dp.enabled
    assert not any(hasattr(dp, old) for old in ("noise_multiplier", "secure", "adaptive", "delta", "participation"))
    release = dp.open(submitted=4, population=None, accountant=None)
    assert release.noise_std == pytest.approx(0.8 * 2.0 / 4)  # dp_noise_multiplier x dp_clip / m on the mean
    assert release.privacy.noise_multiplier == 0.8 and release.privacy.delta == cfg.dp_delta
