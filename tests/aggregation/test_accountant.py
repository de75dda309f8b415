"""The reported epsilon is Opacus's PRV accountant for the sampled Gaussian (issue 31), never above the RDP
cross-check, and the budget stop uses it."""

from __future__ import annotations

import pytest
from opacus.accountants import PRVAccountant, RDPAccountant

from zoo_gym.aggregation import PrivacyAccountant
from zoo_gym.aggregation.privacy import epsilon, prv_epsilon, rdp_epsilon

HISTORIES = [
    [(1.0, 1.0, 10)],                      # the figure (17.87 PRV, 19.05 RDP): everyone every round
    [(1.0, 0.5, 3), (1.0, 0.75, 1)],       # sampled, then a round that widened by a second draw: 1 - (1 - q)^2
]


def _opacus(cls, history, delta=1e-5):
    acct = cls()
    acct.history = list(history)
    return acct.get_epsilon(delta=delta)


@pytest.mark.parametrize("history", HISTORIES)
def test_epsilon_is_opacus_prv_and_never_above_rdp(history):
    ours = PrivacyAccountant(history)
    assert ours.epsilon(delta=1e-5) == pytest.approx(_opacus(PRVAccountant, history), rel=1e-9)
    assert ours.epsilon_rdp(delta=1e-5) == pytest.approx(_opacus(RDPAccountant, history), rel=1e-12)
    assert ours.epsilon(delta=1e-5) <= ours.epsilon_rdp(delta=1e-5)
    if history == HISTORIES[0]:
        assert ours.epsilon(delta=1e-5) == pytest.approx(17.87, abs=0.01)
        assert ours.epsilon_rdp(delta=1e-5) == pytest.approx(19.05, abs=0.01)


def test_sampling_amplifies_and_nothing_costs_nothing():
    assert prv_epsilon([(1.0, 0.1, 1)], delta=1e-5) < rdp_epsilon([(1.0, 0.1, 1)], delta=1e-5) < 4.73
    assert epsilon([], delta=1e-5) == 0.0


def test_stepping_with_a_sample_rate_matches_opacus_stepping():
    ours, ref = PrivacyAccountant(), PRVAccountant()
    for q in (0.25, 0.25, 0.4375):
        ours.step(noise_multiplier=1.0, sample_rate=q)
        ref.step(noise_multiplier=1.0, sample_rate=q)
    assert ours.history == [(1.0, 0.25, 2), (1.0, 0.4375, 1)]
    assert ours.epsilon(delta=1e-5) == pytest.approx(ref.get_epsilon(delta=1e-5), rel=1e-9)
