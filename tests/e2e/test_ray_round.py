"""A real round on a real Ray cluster (issue 50 item 5): `gym-server serve --aggregation-engine ray --ray-address`
over TLS, joined to a `ray.cluster_utils.Cluster` (a head and one one-CPU worker node, each its own raylet and object
store), and two `gym-client join` processes training a few LoRA steps. The round's tasks wait at a gate
(ZOO_GYM_RAY_TASK_GATE in the worker node's environment, zoo_gym/server/rounds/faults.py) while the test copies the
state directory, closed with the round's inputs and nothing published; then the server publishes on Ray, and the
local engine, publishing round 1 from the copy with the same settings, writes the same checkpoint sha256."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from pathlib import Path

import pytest
from sqlmodel import select

from e2e_processes import client, status, stop, tls_server, wait_for
from zoo_gym.server.rounds.faults import TASK_GATE_ENV

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900),
              pytest.mark.skipif(importlib.util.find_spec("ray") is None and not os.environ.get("CI"),
                                 reason="needs the ray extra")]
NODE = {"num_cpus": 1, "object_store_memory": 80 << 20}
# The head schedules nothing and has no dashboard; its agent's port is picked free (a head takes Ray's fixed default,
# which another test's cluster or Flower's simulation on the other pytest worker may hold at the same time).
HEAD = {"num_cpus": 0, "include_dashboard": False, "dashboard_agent_listen_port": None}
CONFIG = ('aggregation-engine = "ray"\nray-address = "{address}"\nray-block-rows = 64\nmin-contributors = 2\n'
          'aggregator = "median"\nvalidation-examples = 8\nround-timeout = 900\n')


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """The cluster, and the gate its worker node's tasks wait at (the raylet's environment is its workers')."""
    from ray.cluster_utils import Cluster

    gate = tmp_path_factory.mktemp("gate")
    os.environ[TASK_GATE_ENV] = str(gate)
    try:
        c = Cluster(initialize_head=True, head_node_args={**NODE, **HEAD})
        c.add_node(**NODE)
        c.wait_for_nodes()
    finally:
        del os.environ[TASK_GATE_ENV]
    yield c, gate
    c.shutdown()


def _published(state_dir: Path, round_id: int) -> dict | None:
    return next((c for c in status(state_dir)["checkpoints"] if c["round"] == round_id), None)


def _publish_locally(state_dir: Path, config_file: Path) -> str:
    """Round 1 of `state_dir` (closed, not published) published by the local engine under the server's settings."""
    from zoo_gym.server.config import build_config, read_config_file
    from zoo_gym.server.rounds.publish import publish_round
    from zoo_gym.server.store.models import Round, Submission
    from zoo_gym.server.store.state import open_state

    values = {k: v for k, v in read_config_file(config_file).items() if not k.startswith("ray")}
    cfg = build_config(values, aggregation_engine="local")
    state = open_state(state_dir)
    try:
        with state.session() as s:
            rnd = s.get(Round, 1)
            subs = list(s.exec(select(Submission).where(Submission.round_id == 1).order_by(Submission.id)))
        outcome = publish_round(state, cfg, rnd, subs)
        assert outcome.startswith("published"), outcome
        with state.session() as s:
            return s.get(Round, 1).published_sha256
    finally:
        state.engine.dispose()


def test_a_served_round_on_ray_publishes_what_the_local_engine_publishes(cluster, tmp_path):
    c, gate = cluster
    state_dir, server, port = tls_server(tmp_path, CONFIG.format(address=c.address))
    clients = []
    try:
        clients = [client(tmp_path, name, port, rounds=1, steps=6, shard=i) for i, name in enumerate("AB")]
        wait_for(lambda: any(gate.glob("task.*")), timeout=600, what="round 1's Ray tasks", procs=[server, *clients])
        shutil.copytree(state_dir, tmp_path / "copy")  # round 1 closed with its inputs; its tasks wait: nothing written
        (gate / "go").touch()
        published = wait_for(lambda: _published(state_dir, 1), timeout=600, what="round 1 to be published",
                             procs=[server, *clients], poll=2.0)
        summaries = []
        for name, p in zip("AB", clients):
            out, _ = p.communicate(timeout=600)
            assert p.returncode == 0, (tmp_path / name / "client.log").read_text()[-3000:]
            summaries += json.loads(out)
    finally:
        stop([*clients, server])
    log = (tmp_path / "server.log").read_text()
    assert "aggregation sharded on Ray" in log
    assert re.search(r"round 1 aggregated by [1-9]\d* Ray tasks", log), log[-3000:]
    assert {s["round"] for s in summaries} == {1}
    assert len(published["lineage"]["contributors"]) == 2
    assert _publish_locally(tmp_path / "copy", tmp_path / "fed.toml") == published["sha256"]
