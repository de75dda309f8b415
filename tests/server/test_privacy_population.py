"""Honest privacy accounting (issue 14 item 7): registrations cost nothing, so they must not shrink epsilon.

Contributors choose to submit; the server does not sample them at random, so amplification by
subsampling does not apply and every round is accounted with q = 1.
"""

from __future__ import annotations

import time

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from zoo_gym import codec
from zoo_gym.aggregation.privacy import epsilon, rdp_epsilon
from zoo_gym.client.upload import register_request
from zoo_gym.server.store.models import Round

DP = dict(aggregator="mean", min_contributors=2, dp_noise_multiplier=1.0, dp_clip=0.05, dp_target_epsilon=1000.0,
          dp_expected_contributors=2,
          register_burst_per_peer=2000, register_burst_global=2000)


def _publish_one_dp_round(fed) -> tuple[float, float]:
    """Two contributions, then wait for round 1 to publish; (epsilon reported by GetRound, q recorded)."""
    for seed in range(2):
        key, cid = fed.register()
        fed.submit(key, cid, codec.encode(fed.small_delta(seed=seed), codec="fp16"))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and fed.round().round_id == 1:
        time.sleep(0.2)
    info = fed.round()
    assert info.round_id == 2, info.message
    with fed.state.session() as s:
        return info.dp_epsilon_spent, s.get(Round, 1).dp_sample_rate


def test_a_thousand_extra_registrations_leave_the_reported_epsilon_unchanged(federation_with):
    honest = federation_with(**DP)
    sybils = federation_with(**DP)
    for i in range(1000):
        assert sybils.stub.Register(register_request(Ed25519PrivateKey.generate(), f"sybil{i}")).created

    eps_honest, q_honest = _publish_one_dp_round(honest)
    eps_sybils, q_sybils = _publish_one_dp_round(sybils)

    assert eps_sybils == eps_honest  # was 4.73 with 2 registered and ~0.03 with 1002 (q = 2 / 1002)
    assert q_honest == q_sybils == 1.0
    # participation public (the ledger): replace-one, z / 2 at q = 1; PRV, below RDP's figure
    assert eps_honest == pytest.approx(epsilon([(0.5, 1.0, 1)], delta=1e-5))
    assert eps_honest < rdp_epsilon([(0.5, 1.0, 1)], delta=1e-5)


def test_the_issue_s_figure_is_what_ten_rounds_cost_at_q_1():
    # z = 1, 10 rounds at delta = 1e-5: 19.05 whatever the number of registered contributors
    # (the old accountant said 0.85 with 1005 registered and 5 contributions a round).
    assert rdp_epsilon([(1.0, 1.0, 10)], delta=1e-5) == pytest.approx(19.0536, abs=1e-4)
