"""/metrics counts what a real round did, and the log has one line per registration, submission and round
transition (a real in-process server, its interceptor, its round manager; the dashboard app over HTTP)."""

from __future__ import annotations

import math

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from sqlmodel import select

from zoo_gym.dashboard import create_app
from zoo_gym.server.store.models import Checkpoint


def _scrape(fed) -> dict[tuple[str, tuple], float]:
    client = TestClient(create_app(fed.state, registry=fed.rounds.metrics.registry))
    response = client.get("/metrics", follow_redirects=False)  # what Prometheus scrapes: no redirect
    assert response.status_code == 200
    text = response.text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_the_round(one_round):
    fed = one_round["fed"]
    m = _scrape(fed)
    assert m[("zoo_gym_submissions_accepted_total", ())] == 3
    assert m[("zoo_gym_submissions_refused_total", (("code", "FAILED_PRECONDITION"),))] == 1
    assert m[("zoo_gym_rpcs_total", (("code", "OK"), ("method", "Register")))] == 3
    assert m[("zoo_gym_rpcs_total", (("code", "OK"), ("method", "SubmitDelta")))] == 3
    assert m[("zoo_gym_rpcs_total", (("code", "FAILED_PRECONDITION"), ("method", "SubmitDelta")))] == 1
    # every accepted payload byte arrived in a message (the late one was refused on its header, before its
    # chunks were read); headers and registrations add a little more
    accepted = one_round["payload_bytes"]
    assert accepted < m[("zoo_gym_received_bytes_total", ())] < accepted + one_round["late_bytes"] + 64 * 1024
    assert m[("zoo_gym_sent_bytes_total", ())] > 0
    assert m[("zoo_gym_rounds_published_total", ())] == 1
    assert m[("zoo_gym_current_round", ())] == 2
    assert m[("zoo_gym_current_round_submissions", ())] == 0
    assert m[("zoo_gym_registered_contributors", ())] == 3
    assert m[("zoo_gym_dp_epsilon_spent", ())] == 0  # no DP in this federation
    with fed.state.session() as s:
        loss = s.exec(select(Checkpoint.heldout_loss).where(Checkpoint.round_id == 1)).one()
    assert loss is not None and math.isclose(m[("zoo_gym_last_heldout_loss", ())], loss)
    assert m[("zoo_gym_publish_seconds_count", ())] == 1
    assert m[("zoo_gym_aggregation_seconds_count", ())] == 1
    assert 0 < m[("zoo_gym_aggregation_seconds_sum", ())] <= m[("zoo_gym_publish_seconds_sum", ())]


def test_each_server_has_its_own_registry(one_round, federation_with):
    other = federation_with()
    assert _scrape(other).get(("zoo_gym_submissions_accepted_total", ())) == 0
    assert _scrape(one_round["fed"])[("zoo_gym_submissions_accepted_total", ())] == 3


def test_one_log_line_per_registration_submission_and_transition(one_round):
    lines = one_round["log"]
    ids = [cid for _, cid in one_round["people"]]
    for cid in ids:
        assert sum(line.startswith(f"registration: contributor {cid}") for line in lines) == 1, lines
        assert sum(line.startswith(f"submission accepted: contributor {cid} round 1") for line in lines) == 1
    refused = [line for line in lines if line.startswith("submission refused")]
    assert len(refused) == 1
    assert f"contributor {ids[0]} round 1: FAILED_PRECONDITION: round 1 is not open" in refused[0]
    assert any(line.startswith("round 1 closed with 3 submissions") for line in lines)
    assert any(line.startswith("round 1: published") for line in lines)
    assert any(line.startswith("round 2 open on base") for line in lines)
