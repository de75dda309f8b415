"""Asynchronous rounds end to end with real processes (issue 16 item 6): one `gym-server serve` in async mode
over TLS (its settings from a config file) and three `gym-client join` processes, one of them 5x slower (5x
the training steps).

The two fast clients train continuously and publish version after version without waiting for the slow
one; the slow client's delta, trained on an older version, is accepted within max_staleness into a later
buffer, weighted and paid less for its staleness (its ledger entry says so), and the ledger verifies.
"""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from e2e_processes import ENV, client, status as _status, wait_for as _wait
from e2e_processes import server_cmd as _server, stop, tls_server

FAST_STEPS, SLOW_STEPS = 10, 50  # the slow client trains 5x as many steps per delta


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("async")
    state_dir, server, port = tls_server(root, 'mode = "async"\nbuffer-size = 2\nmax-staleness = 20\n'
                                         'staleness-exponent = 0.5\nserver-lr = 1.0\naggregator = "median"\n'
                                         'min-quality = 0.0\n')
    clients = []
    try:
        slow = client(root, "slow", port, rounds=1, steps=SLOW_STEPS, shard=2)
        fast = [client(root, name, port, rounds=50, steps=FAST_STEPS, shard=i) for i, name in enumerate("AB")]
        clients = [slow, *fast]
        out, _ = slow.communicate(timeout=1200)
        assert slow.returncode == 0, (root / "slow" / "client.log").read_text()[-3000:]
        slow_summary = json.loads(out)[0]
        cid = slow_summary["contributor"]

        def flushed_with_slow():
            ckpts = _status(state_dir)["checkpoints"]
            return next((c for c in ckpts if cid in c["lineage"].get("contributors", [])), None)

        flush = _wait(flushed_with_slow, timeout=900, what="the slow client's delta to be flushed",
                      procs=[server, *fast])
        stop(fast)
        ledger = subprocess.run(_server("ledger", "show", "--state-dir", str(state_dir), "--limit", "100000",
                                        "--json"), capture_output=True, text=True, check=True, env=ENV)
        verify = subprocess.run(_server("ledger", "verify", "--state-dir", str(state_dir)), capture_output=True,
                                text=True, env=ENV)
        yield {"root": root, "slow": slow_summary, "flush": flush, "status": _status(state_dir),
               "ledger": json.loads(ledger.stdout), "verify": verify, "server": server}
    finally:
        stop([*clients, server])


def test_versions_publish_without_waiting_for_the_slow_client(run):
    slow, flush = run["slow"], run["flush"]
    assert slow["staleness"] >= 1, slow  # versions were published while it trained
    assert slow["round"] == slow["trained_on_round"] + slow["staleness"]
    earlier = [c for c in run["status"]["checkpoints"] if 0 < c["round"] < flush["round"]]
    assert len(earlier) >= slow["staleness"]
    assert all(slow["contributor"] not in c["lineage"]["contributors"] for c in earlier)  # none waited for it
    assert all(len(c["lineage"]["contributors"]) == 2 for c in earlier)  # buffer-size 2, f counted per buffer
    assert run["server"].poll() is None  # still serving


def test_stale_delta_is_accepted_within_s_and_paid_less(run):
    slow, flush = run["slow"], run["flush"]
    cid = slow["contributor"]
    record = flush["lineage"]["async"]["contributors"][cid]
    assert record["staleness"] == slow["staleness"] and record["base_round"] == slow["trained_on_round"]
    assert record["weight"] == pytest.approx((1 + slow["staleness"]) ** -0.5) and record["weight"] < 1
    assert next(s for s in flush["lineage"]["submissions"] if s["contributor"] == cid)["accepted"]
    entry = next(e for e in run["ledger"] if e["contributor_id"] == cid)
    assert entry["round_id"] == flush["round"] and entry["kind"] == "reward", entry
    assert f"staleness {slow['staleness']}" in entry["reason"] and f"flush of version {flush['round']}" in entry["reason"]
    raw = int(re.search(r"gave (\d+), x staleness weight", entry["reason"]).group(1))
    assert raw >= 1 and entry["amount"] == int(raw * record["weight"]) < raw  # paid less than undiscounted


def test_ledger_verifies(run):
    assert run["verify"].returncode == 0, run["verify"].stdout + run["verify"].stderr
    assert "ledger OK" in run["verify"].stdout
