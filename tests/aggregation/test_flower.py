"""DeltaSoupStrategy inside Flower's simulation engine (ray): 12 virtual clients, 3 sign-flip
attackers. Multi-Krum through DeltaSoup stays near the honest mean; the plain mean does not."""

from __future__ import annotations

import numpy as np
import pytest

flwr = pytest.importorskip("flwr")
pytest.importorskip("ray")

from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict  # noqa: E402
from flwr.clientapp import ClientApp  # noqa: E402
from flwr.serverapp import Grid, ServerApp  # noqa: E402
from flwr.simulation import run_simulation  # noqa: E402

from zoo_gym.aggregation import SoupConfig  # noqa: E402
from zoo_gym.integrations.flower.strategy import DeltaSoupStrategy  # noqa: E402

N_CLIENTS, N_ATTACKERS, D = 12, 3, 64
HONEST_MU = np.linspace(-1.0, 1.0, D).astype(np.float32) * 0.1  # every honest client's mean step


def _client_delta(partition: int) -> np.ndarray:
    rng = np.random.default_rng(partition)
    honest = HONEST_MU + rng.normal(0.0, 0.005, D).astype(np.float32)
    return -10.0 * HONEST_MU if partition < N_ATTACKERS else honest


def _train(msg: Message, context: Context) -> Message:
    partition = int(context.node_config["partition-id"])
    arrays = msg.content["arrays"].to_numpy_ndarrays()
    new = [arrays[0] + _client_delta(partition).astype(arrays[0].dtype)]
    content = RecordDict({"arrays": ArrayRecord(new),
                          "metrics": MetricRecord({"num-examples": 1_000_000 if partition < N_ATTACKERS else 10})})
    return Message(content=content, reply_to=msg)


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_simulation_multikrum_resists_sign_flip_and_mean_does_not():
    outcome: dict[str, np.ndarray] = {}
    reports: dict[str, object] = {}
    client_app = ClientApp()
    client_app.train()(_train)
    server_app = ServerApp()

    @server_app.main()
    def main(grid: Grid, context: Context) -> None:
        for name, cfg in [("mean", SoupConfig(aggregator="mean")),
                          ("multi-krum", SoupConfig(aggregator="multi-krum", byzantine_f=3))]:
            strategy = DeltaSoupStrategy(cfg, fraction_evaluate=0.0,
                                         min_train_nodes=N_CLIENTS, min_available_nodes=N_CLIENTS)
            start = ArrayRecord([np.zeros(D, dtype=np.float32)])
            result = strategy.start(grid=grid, initial_arrays=start, num_rounds=1)
            outcome[name] = result.arrays.to_numpy_ndarrays()[0]
            reports[name] = strategy.reports[-1]

    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=N_CLIENTS,
                   backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                   "init_args": {"address": "local", "num_cpus": 2, "include_dashboard": False}})

    honest_mean = np.mean([_client_delta(p) for p in range(N_ATTACKERS, N_CLIENTS)], axis=0)
    err_krum = np.linalg.norm(outcome["multi-krum"] - honest_mean) / np.linalg.norm(honest_mean)
    err_mean = np.linalg.norm(outcome["mean"] - honest_mean) / np.linalg.norm(honest_mean)
    assert err_krum < 0.05
    assert err_mean > 2.0  # (9 * 1 - 3 * 10) / 12 = -1.75 of mu: 2.75 relative error
    report = reports["multi-krum"]
    assert report.n_accepted == N_CLIENTS
    assert sum(r.selected for r in report.contributors) == N_CLIENTS - 3
    # attackers' inflated num-examples gave them no weight: none of them selected
    assert all(not r.selected for r in report.contributors if r.weight == 0.0)
    assert sum(r.weight for r in report.contributors) == pytest.approx(1.0)
