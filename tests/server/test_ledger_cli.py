"""The ledger as people use it: `gym-server ledger verify` and `gym-client rewards --verify`."""

from __future__ import annotations

import json

from sqlalchemy import text
from typer.testing import CliRunner

from zoo_gym import codec
from zoo_gym.client.cli import app as client_app
from zoo_gym.server.cli import app as server_app

DATABASES = ("sqlite", "postgresql")  # the federation runs on each (tests/conftest.py)


def _publish_one_round(federation, tmp_path) -> list:
    keys = []
    for seed in range(2):
        key, cid = federation.register()
        from cryptography.hazmat.primitives import serialization

        path = tmp_path / f"key{seed}.pem"
        path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
        federation.submit(key, cid, codec.encode(federation.small_delta(seed=seed), codec="bitdelta"))
        keys.append((path, cid))
    federation.wait_published(1)
    return keys


def test_verify_passes_then_names_the_first_tampered_entry(federation, tmp_path):
    keys = _publish_one_round(federation, tmp_path)
    state_dir = str(federation.state.root)
    runner = CliRunner()
    ok = runner.invoke(server_app, ["ledger", "verify", "--state-dir", state_dir])
    assert ok.exit_code == 0 and "ledger OK: 2 entries" in ok.output

    server = f"127.0.0.1:{federation.port}"
    res = runner.invoke(client_app, ["rewards", "--server", server, "--insecure", "--key", str(keys[0][0]), "--json",
                                     "--verify"])
    assert res.exit_code == 0, res.output
    assert "trusting the server at" in res.stderr and "on first use" in res.stderr  # said on stderr, not in the JSON
    doc = json.loads(res.stdout)
    assert doc["contributor_id"] == keys[0][1] and doc["verification"]["ok"]
    assert doc["balance"] == doc["sum_of_entries"] and doc["entries"] == 1

    with federation.state.engine.begin() as conn:  # an insider edits an amount directly in the database
        conn.execute(text("UPDATE ledger_entry SET amount = amount + 500 WHERE seq = 2"))
    bad = runner.invoke(server_app, ["ledger", "verify", "--state-dir", state_dir])
    assert bad.exit_code == 1 and "entry 2" in bad.output
    who = json.loads(runner.invoke(server_app, ["ledger", "show", "--state-dir", state_dir, "--json"]).output)
    victim = next(e["contributor_id"] for e in who if e["seq"] == 2)
    path = next(p for p, cid in keys if cid == victim)
    res = runner.invoke(client_app, ["rewards", "--server", server, "--insecure", "--key", str(path), "--verify"])
    assert res.exit_code == 1 and "VERIFICATION FAILED at entry 2" in res.output


def test_deleting_an_entry_is_detected(federation, tmp_path):
    _publish_one_round(federation, tmp_path)
    with federation.state.engine.begin() as conn:
        conn.execute(text("DELETE FROM ledger_entry WHERE seq = 1"))
    res = CliRunner().invoke(server_app, ["ledger", "verify", "--state-dir", str(federation.state.root)])
    assert res.exit_code == 1 and "BROKEN" in res.output


def test_verify_says_its_progress_on_stderr(federation, tmp_path, monkeypatch):
    """Issue 51: a ledger of 10,000 entries is checked in batches and the command says how far it got."""
    from zoo_gym.server.store import queries

    monkeypatch.setattr(queries, "PROGRESS_EVERY", 1)
    _publish_one_round(federation, tmp_path)
    res = CliRunner().invoke(server_app, ["ledger", "verify", "--state-dir", str(federation.state.root), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["checked"] == 2
    assert "ledger verify: 1 of 2 entries checked" in res.stderr and "ledger verify: 2 of 2" in res.stderr
