"""The package's Flower apps in Flower's simulation engine (ray): 10 virtual contributors train the tiny
model (LoRA, 1 step each), reply BitDelta payloads, and two rounds of DeltaSoup (trimmed mean) with
central DP (the fixed-denominator mean, the only rule DP runs with) publish a new global model and account
epsilon."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flwr", reason="the Flower apps need flwr (extra `flower`)")
pytest.importorskip("ray", reason="Flower's simulation engine needs ray (extra `simulation`)")

from flwr.simulation import run_simulation  # noqa: E402

from zoo_gym.aggregation import SoupConfig  # noqa: E402
from zoo_gym.integrations.flower.apps import (SampledSoupStrategy, client_app, heldout_evaluate_fn,  # noqa: E402
                                             seed_from_secret, server_app, tiny_arrays)
from zoo_gym.gym_train import default_validation_examples  # noqa: E402

N = 10


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ten_contributors_two_rounds_bitdelta_deltasoup_dp():
    config = SoupConfig(aggregator="mean", dp_noise_multiplier=0.5, dp_clip=1.0, dp_expected_contributors=N,
                        dp_delta=1e-6)
    results: list = []
    losses: list[float] = []
    app = server_app(config, sample_rate=1.0, num_rounds=2, population=N, train_config={"steps": 1},
                     evaluate_fn=heldout_evaluate_fn(default_validation_examples(16), losses), results=results)
    run_simulation(server_app=app, client_app=client_app(), num_supernodes=N,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"address": "local", "num_cpus": 2, "include_dashboard": False}})

    (strategy, arrays), = results
    assert strategy.cohorts == [N, N]
    assert [r.n_accepted for r in strategy.reports] == [N, N]
    assert all(r.noise_std == pytest.approx(0.5 * 1.0 / N) for r in strategy.reports)
    assert strategy.accountant.epsilon(delta=1e-6) > 0
    assert len(losses) == 3 and all(np.isfinite(losses))  # the base, then after each round
    start = tiny_arrays()
    moved = sum(float(np.abs(arrays[k].numpy() - start[k].numpy()).sum()) for k in start)
    assert moved > 0


def _secret_sampling(wanted, *, q: float) -> bytes:
    """An operator's secret whose draws give per-round cohort sizes `wanted` accepts (the sampler draws N uniforms a
    round, in node order)."""
    import random

    for i in range(10_000):
        secret = i.to_bytes(16, "big")
        rng = random.Random(seed_from_secret(secret, "sampling"))
        if wanted([sum(rng.random() < q for _ in range(N)) for _ in range(2)]):
            return secret
    raise AssertionError("no secret found")


def test_sampling_and_noise_draw_from_the_os_unless_the_operator_holds_a_secret():
    """A public seed would let anyone recompute who was sampled (voiding amplification) and the noise."""
    config = SoupConfig(aggregator="mean", dp_noise_multiplier=1.0, dp_clip=1.0, dp_expected_contributors=2)
    draws = [[s._rng.random() for _ in range(8)] for s in (SampledSoupStrategy(config, sample_rate=0.5)
                                                           for _ in range(2))]
    assert draws[0] != draws[1]
    again = [[s._rng.random() for _ in range(8)] for s in (SampledSoupStrategy(config, sample_rate=0.5, seed=b"k" * 16)
                                                           for _ in range(2))]
    assert again[0] == again[1]
    with pytest.raises(ValueError, match="secret of at least 16 bytes"):
        SampledSoupStrategy(config, sample_rate=0.5, seed=b"0")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_round_that_samples_nobody_is_still_accounted_as_opacus_would():
    from opacus.accountants import PRVAccountant, RDPAccountant

    z, q, delta = 1.0, 0.2, 1e-6
    config = SoupConfig(aggregator="mean", dp_noise_multiplier=z, dp_clip=1.0, dp_expected_contributors=2,
                        dp_delta=delta, dp_participation="private")
    results: list = []
    secret = _secret_sampling(lambda c: c[0] == 0 and c[1] == 2, q=q)  # none in round 1, two in round 2
    app = server_app(config, sample_rate=q, num_rounds=2, population=N, seed=secret, train_config={"steps": 1},
                     results=results)
    run_simulation(server_app=app, client_app=client_app(), num_supernodes=N,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"address": "local", "num_cpus": 2, "include_dashboard": False}})

    (strategy, _), = results
    assert strategy.cohorts == [0, 2]
    assert len(strategy.reports) == 1  # only round 2 published
    assert strategy.accountant.history == [(z, q, 2)]  # but both rounds the sampler ran are accounted
    expected = []
    for cls in (PRVAccountant, RDPAccountant):
        acct = cls()
        for _ in range(2):
            acct.step(noise_multiplier=z, sample_rate=q)
        expected.append(acct.get_epsilon(delta=delta))
    assert strategy.accountant.epsilon(delta=delta) == pytest.approx(min(expected), rel=1e-9)
    assert strategy.accountant.epsilon_rdp(delta=delta) == pytest.approx(expected[1], rel=1e-9)
    assert strategy.reports[0].privacy.q == q  # the sampler's rate, not m / N
