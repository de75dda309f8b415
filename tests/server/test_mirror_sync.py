"""`gym-server mirror-sync DIR` (issue 50 item 3): the stored published checkpoints copied into DIR as
DIR/<sha256>, the layout a `--mirror URL` serves; what is already there (right size and sha256) is not
copied again, a wrong file of that name is replaced, and a checkpoint retention removed is reported gone."""

from __future__ import annotations

import hashlib
import json
import os
import stat

from sqlmodel import select
from typer.testing import CliRunner

from zoo_gym.server.cli import app
from zoo_gym.server.genesis import init_state
from zoo_gym.server.store.models import Checkpoint


def _sync(out, state_dir, *extra):
    res = CliRunner().invoke(app, ["mirror-sync", str(out), "--state-dir", str(state_dir), *extra])
    assert res.exit_code == 0, res.output
    return res


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_mirror_sync_copies_each_blob_once_and_atomically(tmp_path):
    state = init_state(tmp_path / "state", base_model="tiny")
    with state.session() as s:
        [genesis] = list(s.exec(select(Checkpoint)))
    out = tmp_path / "www" / "zoo"

    first = json.loads(_sync(out, tmp_path / "state", "--json").stdout)
    assert first["copied"] == [genesis.sha256] and first["present"] == [] and first["gone"] == []
    assert first["bytes_copied"] == genesis.size == (out / genesis.sha256).stat().st_size
    assert _sha(out / genesis.sha256) == genesis.sha256
    assert stat.S_IMODE(os.stat(out / genesis.sha256).st_mode) & 0o004  # the web server may read it
    assert sorted(p.name for p in out.iterdir()) == [genesis.sha256]  # no temporary file left

    again = json.loads(_sync(out, tmp_path / "state", "--json").stdout)
    assert again["copied"] == [] and again["present"] == [genesis.sha256] and again["bytes_copied"] == 0
    line = _sync(out, tmp_path / "state").stdout
    assert line.startswith(f"copied 0 checkpoint(s) (0 bytes) into {out}; 1 already there")

    # a file of the right size but other bytes is replaced (not with --size-only, which trusts the size)
    (out / genesis.sha256).write_bytes(bytes(genesis.size))
    assert json.loads(_sync(out, tmp_path / "state", "--json", "--size-only").stdout)["copied"] == []
    assert json.loads(_sync(out, tmp_path / "state", "--json").stdout)["copied"] == [genesis.sha256]
    assert _sha(out / genesis.sha256) == genesis.sha256
    # a truncated one too, even with --size-only
    with open(out / genesis.sha256, "r+b") as f:
        f.truncate(10)
    assert json.loads(_sync(out, tmp_path / "state", "--json", "--size-only").stdout)["copied"] == [genesis.sha256]
    assert _sha(out / genesis.sha256) == genesis.sha256


def test_a_checkpoint_no_longer_stored_is_reported_gone_not_copied(tmp_path):
    state = init_state(tmp_path / "state", base_model="tiny")
    retired = "ab" * 32
    with state.session() as s:
        s.add(Checkpoint(sha256=retired, round_id=1, size=123))
        s.commit()
    report = json.loads(_sync(tmp_path / "www", tmp_path / "state", "--json").stdout)
    assert report["gone"] == [retired] and len(report["copied"]) == 1
    assert not (tmp_path / "www" / retired).exists()
    assert "1 no longer stored here" in _sync(tmp_path / "www", tmp_path / "state").stdout


def test_a_stored_blob_that_does_not_hash_to_its_name_is_not_copied(tmp_path):
    state = init_state(tmp_path / "state", base_model="tiny")
    with state.session() as s:
        [genesis] = list(s.exec(select(Checkpoint)))
    path = state.blobs.path(genesis.sha256)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.seek(100)
        f.write(b"\xff\x00\xff")
    res = CliRunner().invoke(app, ["mirror-sync", str(tmp_path / "www"), "--state-dir", str(tmp_path / "state")])
    assert res.exit_code == 2 and "does not hash to its name" in res.output and "Traceback" not in res.output
    assert list((tmp_path / "www").iterdir()) == []  # neither the copy nor its temporary file
