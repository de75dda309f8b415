"""`gym-server status` tells an operator what the round is waiting for: who submitted (by name), when it
closes, which rule merges it, how many contributors there are and the privacy spent (issue 15: status hid
names, deadlines and epsilon)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from zoo_gym import codec
from zoo_gym.client.upload import register_request
from zoo_gym.server.cli import app

runner = CliRunner()


def test_status_names_submitters_deadline_rule_contributors_and_privacy(federation_with):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    fed = federation_with(min_contributors=2, round_timeout=900)
    key = Ed25519PrivateKey.generate()
    cid = fed.stub.Register(register_request(key, "alice-lab")).contributor_id
    fed.register()  # a second contributor who has not submitted
    fed.submit(key, cid, codec.encode(fed.small_delta(), codec="fp16"))
    state_dir = str(fed.state.root)  # status reads beside the live server

    text = runner.invoke(app, ["status", "--state-dir", state_dir])
    assert text.exit_code == 0, text.output
    out = text.output
    assert "alice-lab" in out and cid[:12] in out  # who submitted, by name
    assert "1 submission," in out
    assert "closes at" in out and "UTC" in out  # the deadline, once the first submission started the clock
    assert "aggregator mean" in out
    assert "contributors: 2 registered" in out
    assert "privacy: off" in out  # no DP configured: said, not hidden

    doc = json.loads(runner.invoke(app, ["status", "--state-dir", state_dir, "--json"]).output)
    sub = doc["round"]["submissions"][0]
    assert sub["display_name"] == "alice-lab" and doc["round"]["deadline_unix"] > 0
    assert doc["contributors"] == 2 and doc["dp_epsilon_spent"] is None


def test_status_shows_the_serve_mode_as_the_latest_closed_round_recorded_it(federation_with):
    """Issue 16: status hid whether the federation runs sync or async rounds and with which buffer, since the
    mode is serve configuration; it is shown from what the latest closed round recorded."""


    fed = federation_with(mode="async", buffer_size=2, max_staleness=3, server_lr=0.5, staleness_exponent=1.0,
                          aggregator="mean", validation_examples=0)
    state_dir = str(fed.state.root)
    before = runner.invoke(app, ["status", "--state-dir", state_dir])
    assert before.exit_code == 0, before.output
    assert "mode: not recorded yet" in before.output  # nothing closed yet: said, not guessed

    for seed in range(2):  # a full buffer of K = 2 flushes version 1
        key, cid = fed.register()
        fed.submit(key, cid, codec.encode(fed.small_delta(seed=seed), codec="fp32"))
    fed.wait_published(1)

    out = runner.invoke(app, ["status", "--state-dir", state_dir]).output
    assert "mode: async, buffer size 2, max staleness 3, server lr 0.5, staleness weight (1+s)^-1 (as round 1 " \
           "closed)" in out
    doc = json.loads(runner.invoke(app, ["status", "--state-dir", state_dir, "--json"]).output)
    assert doc["mode"] == {"mode": "async", "as_of_round": 1, "buffer_size": 2, "max_staleness": 3,
                           "server_lr": 0.5, "staleness_exponent": 1.0}


def test_the_open_round_names_the_rule_it_is_served_with(federation_with):
    """Issue 49: a round row's default rule is SoupConfig's (one declaration), and `serve` records the rule it
    serves on the open round, so status names the rule the round runs under, not a default."""
    from zoo_gym.aggregation import SoupConfig
    from zoo_gym.server.store.models import Round

    assert Round(id=1, base_sha256="0" * 64).aggregator == SoupConfig().aggregator
    fed = federation_with(aggregator="median", validation_examples=0)
    out = runner.invoke(app, ["status", "--state-dir", str(fed.state.root)]).output
    assert "aggregator median" in out, out


def test_status_names_twenty_submitters_and_counts_the_rest(federation_with):
    """Issue 51: a round of 10,000 made `status` print 10,000 lines; the text names 20 and counts the rest,
    --json still lists every one."""
    from zoo_gym.server.cli import STATUS_LINES

    fed = federation_with(min_contributors=STATUS_LINES + 10, round_timeout=900, register_burst_per_peer=100)
    for i in range(STATUS_LINES + 3):
        key, cid = fed.register()
        fed.submit(key, cid, codec.encode(fed.small_delta(seed=i), codec="fp16"))
    state_dir = str(fed.state.root)
    out = runner.invoke(app, ["status", "--state-dir", state_dir]).output
    assert f"{STATUS_LINES + 3} submissions" in out and out.count(" bytes  fp16") == STATUS_LINES
    assert "... and 3 more (`gym-server status --json` lists every one)" in out
    doc = json.loads(runner.invoke(app, ["status", "--state-dir", state_dir, "--json"]).output)
    assert len(doc["round"]["submissions"]) == STATUS_LINES + 3
