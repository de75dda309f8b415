"""The package's Flower apps in Flower's simulation engine (ray): 10 virtual contributors train the tiny
model (LoRA, 1 step each), reply BitDelta payloads, and two rounds of DeltaSoup (trimmed mean) with
central DP publish a new global model and account epsilon."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("flwr", reason="the Flower apps need flwr (extra `flower`)")
pytest.importorskip("ray", reason="Flower's simulation engine needs ray (extra `simulation`)")

from flwr.simulation import run_simulation  # noqa: E402

from zoo_gym.aggregation import SoupConfig  # noqa: E402
from zoo_gym.aggregation.flower_apps import (client_app, heldout_evaluate_fn, server_app,  # noqa: E402
                                             tiny_arrays)
from zoo_gym.gym_train import default_validation_examples  # noqa: E402

N = 10


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ten_contributors_two_rounds_bitdelta_deltasoup_dp():
    config = SoupConfig(dp_noise_multiplier=0.5, dp_clip=1.0, dp_expected_contributors=N, dp_delta=1e-6)
    results: list = []
    losses: list[float] = []
    app = server_app(config, sample_rate=1.0, num_rounds=2, population=N, train_config={"steps": 1},
                     evaluate_fn=heldout_evaluate_fn(default_validation_examples(16), losses), results=results)
    run_simulation(server_app=app, client_app=client_app(), num_supernodes=N,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": 2, "include_dashboard": False}})

    (strategy, arrays), = results
    assert strategy.cohorts == [N, N]
    assert [r.n_accepted for r in strategy.reports] == [N, N]
    assert all(r.noise_std == pytest.approx(0.5 * 1.0 / N) for r in strategy.reports)
    assert strategy.accountant.epsilon(delta=1e-6) > 0
    assert len(losses) == 3 and all(np.isfinite(losses))  # the base, then after each round
    start = tiny_arrays()
    moved = sum(float(np.abs(arrays[k].numpy() - start[k].numpy()).sum()) for k in start)
    assert moved > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_round_that_samples_nobody_is_still_accounted_as_opacus_would():
    from opacus.accountants import PRVAccountant, RDPAccountant

    z, q, delta = 1.0, 0.2, 1e-6
    config = SoupConfig(aggregator="mean", dp_noise_multiplier=z, dp_clip=1.0, dp_expected_contributors=2,
                        dp_delta=delta)
    results: list = []
    # seed 61: random.Random(61) samples none of the 10 nodes in round 1 and two in round 2 at q = 0.2
    app = server_app(config, sample_rate=q, num_rounds=2, population=N, seed=61, train_config={"steps": 1},
                     results=results)
    run_simulation(server_app=app, client_app=client_app(), num_supernodes=N,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"num_cpus": 2, "include_dashboard": False}})

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
