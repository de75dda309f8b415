"""A federation started on a released version keeps running after the upgrade, with today's clients (issue 47).

The frozen state directories were written by each release's own code (tests/fixtures/make_f956b6f_state.py,
make_v0_1_0_state.py: `gym-server init`, two real clients, round 1 published, a verified ledger). Their round-1
checkpoint's lineage carries no server signature: lineages were signed only later. Here, on a copy, with real
processes of today's code on 127.0.0.1: `gym-server migrate`, `gym-server serve --insecure`, `gym-client pull`
of the old round-1 checkpoint, then two `gym-client join --rounds 1` that train round 2 on it. Each says in one
line that the base's lineage predates signing and why it was accepted; round 2 publishes (signed);
`gym-server ledger verify` passes across the upgrade; `gym-server export --round 1` writes the old checkpoint;
the dashboard lists round 1 from the old release and round 2 from today.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from e2e_processes import ENV, server_cmd, status, stop, wait_for
from zoo_gym.proto import archive, signing

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
RELEASES = {"f956b6f": "the first release, f956b6f", "v0.1.0": "release 0.1.0"}
STEPS = 6  # optimizer steps per contributor: a real delta, in seconds on the tiny model
TIMEOUT = 150  # seconds any one process or wait may take


def _run(*args: str, timeout: float = TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), capture_output=True, text=True, env=ENV, timeout=timeout)


def _client(*args: str) -> list[str]:
    return [sys.executable, "-m", "zoo_gym.client", *args]


def _join(root: Path, name: str, port: int, shard: int) -> subprocess.Popen:
    work = root / name
    work.mkdir()
    cmd = _client("join", "--server", f"127.0.0.1:{port}", "--insecure", "--rounds", "1", "--data", "builtin",
                  "--shard", str(shard), "--n-shards", "8", "--workdir", str(work), "--key", str(work / "key.pem"),
                  "--max-steps", str(STEPS), "--warmup-steps", "0", "--batch-size", "8", "--threads", "1",
                  "--quiet", "--json", "--name", name)
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(work / "client.log", "w"), env=ENV, text=True)


def _said_about_the_base(text: str, sha256: str, release: str) -> None:
    line = (f"base checkpoint {sha256[:12]} (round 1): lineage from before signing ({RELEASES[release]}), accepted "
            "because the server-signed round state names its sha256 and the checkpoint hashes to it")
    assert line in text.splitlines(), text[-3000:]


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_a_released_state_upgrades_and_serves_its_next_round_to_todays_clients(tmp_path, release):
    made_by = json.loads((FIXTURES / f"state-{release}" / "made_by.json").read_text())
    old_sha = made_by["round_1_checkpoint"]
    state_dir = tmp_path / "state"
    shutil.copytree(FIXTURES / f"state-{release}", state_dir)  # never touch the fixture itself
    migrated = _run(*server_cmd("migrate", "--state-dir", str(state_dir)))
    assert migrated.returncode == 0, migrated.stdout + migrated.stderr

    port_file = tmp_path / "port"
    server = subprocess.Popen(server_cmd("serve", "--state-dir", str(state_dir), "--insecure", "--host", "127.0.0.1",
                                         "--port", "0", "--port-file", str(port_file), "--aggregator", "mean",
                                         "--min-contributors", "2", "--round-timeout", "600"),
                              stderr=open(tmp_path / "server.log", "w"), env=ENV)
    procs = [server]
    try:
        port = wait_for(lambda: port_file.exists() and port_file.read_text().strip() and int(port_file.read_text()),
                        timeout=TIMEOUT, what="the server to listen", procs=[server])
        # today's `gym-client pull` of the checkpoint the old release published
        pulled = _run(*_client("pull", "--server", f"127.0.0.1:{port}", "--insecure", "--workdir",
                               str(tmp_path / "puller"), "--quiet", "--json", str(tmp_path / "pulled")))
        assert pulled.returncode == 0, pulled.stderr
        assert (json.loads(pulled.stdout)["round"], json.loads(pulled.stdout)["sha256"]) == (1, old_sha)
        _said_about_the_base(pulled.stderr, old_sha, release)
        assert signing.LINEAGE_SIGNATURE not in json.loads((tmp_path / "pulled" / archive.LINEAGE).read_text())

        joins = [_join(tmp_path, "A", port, 0), _join(tmp_path, "B", port, 1)]
        procs += joins
        summaries = {}
        for name, p in zip("AB", joins):
            out, _ = p.communicate(timeout=TIMEOUT)
            log = (tmp_path / name / "client.log").read_text()
            assert p.returncode == 0, log[-3000:]
            summaries[name] = json.loads(out)
            _said_about_the_base(log, old_sha, release)
        assert [s["round"] for name in "AB" for s in summaries[name]] == [2, 2]
        doc = wait_for(lambda: (d := status(state_dir)) and {r["id"]: r["state"] for r in d["rounds"]}.get(2)
                       == "published" and d, timeout=TIMEOUT, what="round 2 to be published", procs=[server])
    finally:
        stop(procs)

    ckpts = {c["round"]: c for c in doc["checkpoints"]}
    assert ckpts[1]["sha256"] == old_sha and ckpts[2]["parent_sha256"] == old_sha
    new_sha = ckpts[2]["sha256"]
    new_dir = archive.unpack(state_dir / "blobs" / "sha256" / new_sha[:2] / new_sha, tmp_path / "round2")
    assert len(json.loads((new_dir / archive.LINEAGE).read_text())[signing.LINEAGE_SIGNATURE]) == 128  # today's

    verified = _run(*server_cmd("ledger", "verify", "--state-dir", str(state_dir)))
    assert verified.returncode == 0 and "ledger OK: 4 entries" in verified.stdout, verified.stdout + verified.stderr
    shown = json.loads(_run(*server_cmd("ledger", "show", "--state-dir", str(state_dir), "--json")).stdout)
    assert shown[:2] == made_by["ledger"] and {e["round_id"] for e in shown[2:]} == {2}  # the old entries as made

    exported = _run(*server_cmd("export", "--state-dir", str(state_dir), "--round", "1", str(tmp_path / "round1")))
    assert exported.returncode == 0 and old_sha[:12] in exported.stdout, exported.stdout + exported.stderr
    assert (tmp_path / "round1" / archive.WEIGHTS).is_file()
    assert f"checkpoint_sha256: {old_sha}" in (tmp_path / "round1" / "README.md").read_text()

    from fastapi.testclient import TestClient

    from zoo_gym.dashboard import create_app
    from zoo_gym.server.store.state import open_state

    state = open_state(state_dir)
    try:
        web = TestClient(create_app(state))
        rounds = {r["id"]: r for r in web.get("/api/rounds").json()}
        assert (rounds[1]["state"], rounds[1]["published_sha256"]) == ("published", old_sha)  # the old release's
        assert (rounds[2]["state"], rounds[2]["published_sha256"]) == ("published", new_sha)  # today's
        assert rounds[2]["submissions"] == 2
        lineage = [(c["round"], c["sha256"]) for c in web.get("/api/checkpoints").json()]
        assert (1, old_sha) in lineage and (2, new_sha) in lineage
        page = web.get("/")
        assert page.status_code == 200
        assert all(f'data-round="{i}"' in page.text and sha[:12] in page.text
                   for i, sha in ((1, old_sha), (2, new_sha)))
    finally:
        state.engine.dispose()
