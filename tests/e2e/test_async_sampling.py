"""Asynchronous rounds with server-side Poisson sampling end to end (issue 31), real processes: one `gym-server
serve` in async mode with --sample-rate 0.5 and central DP, four `gym-client join` processes.

Every buffer flushed holds only deltas of contributors the server's key selected for it (the clients register
after version 1 opened, so they are eligible from a later draw on), each published version records the rate its
draws gave each person, and the epsilon reported is the accountant's for exactly those rates.
"""

from __future__ import annotations

import pytest

from e2e_processes import client, open_round, status as _status, stop, tls_server, wait_for as _wait
from zoo_gym.aggregation.privacy import epsilon
from zoo_gym.server.rounds import sampling
from zoo_gym.server.store.models import Contributor, Round, RoundInputs
from zoo_gym.server.store.state import open_state

Q, Z, DELTA, VERSIONS = 0.5, 1.0, 1e-5, 2


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("async-sampling")
    state_dir, server, port = tls_server(
        root, f'mode = "async"\nbuffer-size = 2\nmax-staleness = 20\naggregator = "mean"\n'
              f'min-quality = 0.0\nsample-rate = {Q}\nround-timeout = 10\n'
              f'dp-noise-multiplier = {Z}\ndp-clip = 1.0\ndp-delta = {DELTA}\ndp-expected-contributors = 2\n')
    clients = []
    try:
        clients = [client(root, name, port, rounds=50, steps=10, shard=i) for i, name in enumerate("ABCD")]

        def published():
            if open_round(port, root / "tls" / "ca.pem") <= VERSIONS:  # versions 1..VERSIONS not all closed yet
                return False
            done = [r for r in _status(state_dir)["rounds"] if r["state"] == "published"]
            return len(done) >= VERSIONS and done

        _wait(published, timeout=900, what=f"{VERSIONS} versions to publish", procs=[server, *clients])
        stop(clients)
        yield {"root": root, "state_dir": state_dir, "status": _status(state_dir), "server": server}
    finally:
        stop([*clients, server])


def test_every_flushed_delta_came_from_someone_selected_for_that_buffer(run):
    state = open_state(run["state_dir"])
    key = sampling.selection_key(state.key)
    flushed = [c for c in run["status"]["checkpoints"] if c["round"] > 0]
    assert len(flushed) >= VERSIONS
    with state.session() as s:
        for ckpt in flushed:
            rnd = s.get(Round, ckpt["round"])
            for cid in ckpt["lineage"]["contributors"]:
                registered = s.get(Contributor, cid).registered_at
                assert sampling.is_selected(key, rnd, cid, registered, Q), (ckpt["round"], cid)
    assert run["server"].poll() is None  # still serving


def test_each_version_is_charged_its_draws_rate_and_epsilon_is_the_accountants(run):
    published = [r for r in run["status"]["rounds"] if r["state"] == "published"]
    state = open_state(run["state_dir"])
    with state.session() as s:
        draws = {r["id"]: len(sampling.cutoffs(s.get(Round, r["id"]))) for r in published}
    with state.session() as s:
        rates = [s.get(RoundInputs, r["id"]).sample_rate for r in published]  # what each version's draws gave
    assert rates == [pytest.approx(sampling.effective_rate(Q, draws[r["id"]])) for r in published]
    assert all(q < 1 for q in rates)
    assert draws[published[0]["id"]] >= 2  # version 1: the clients registered after its first draw
    # but the ledger names whom each version paid: participation is public, so each flush is charged
    # replace-one (z / 2) at q = 1, and the sampling amplifies nothing
    assert all(r["dp_sample_rate"] == 1.0 for r in published)
    history = [(Z / 2, 1.0, 1) for _ in rates]
    assert published[-1]["dp_epsilon_total"] == pytest.approx(epsilon(history, delta=DELTA), rel=1e-9)
    assert run["status"]["dp_epsilon_spent"] == published[-1]["dp_epsilon_total"]
