"""Smaller leaks (issue 14 item 8): you_submitted only to its signed owner; the state directory is private."""

from __future__ import annotations

import stat
import time
from pathlib import Path

import grpc
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from typer.testing import CliRunner

from zoo_gym import codec
from zoo_gym.client.upload import get_round_request
from zoo_gym.proto import gym_pb2
from zoo_gym.server.cli import app
from zoo_gym.server.store.state import DB_FILE, open_state


def _refused(call, code: grpc.StatusCode, match: str) -> None:
    with pytest.raises(grpc.RpcError) as info:
        call()
    assert info.value.code() == code, info.value.details()
    assert match in info.value.details(), info.value.details()


@pytest.fixture
def submitted(federation):
    """(key, contributor id) of a contributor with an accepted submission in the open round."""
    key, cid = federation.register()
    federation.submit(key, cid, codec.encode(federation.small_delta(), codec="fp16"))
    return key, cid


def test_unsigned_get_round_does_not_reveal_whether_someone_submitted(federation, submitted):
    _, cid = submitted
    info = federation.stub.GetRound(gym_pb2.GetRoundRequest(contributor_id=cid))
    assert info.submissions == 1 and not info.you_submitted  # the count is public; who submitted is not


def test_owner_signed_get_round_says_you_submitted(federation, submitted):
    key, cid = submitted
    assert federation.stub.GetRound(get_round_request(key, cid)).you_submitted
    other_key, other = federation.register()
    assert not federation.stub.GetRound(get_round_request(other_key, other)).you_submitted


def test_forged_get_round_signature_is_unauthenticated(federation, submitted):
    _, cid = submitted
    forged = get_round_request(Ed25519PrivateKey.generate(), cid)  # signed by someone else's key
    _refused(lambda: federation.stub.GetRound(forged), grpc.StatusCode.UNAUTHENTICATED, "signature")
    unknown = Ed25519PrivateKey.generate()
    _refused(lambda: federation.stub.GetRound(get_round_request(unknown, "f" * 32)),
             grpc.StatusCode.UNAUTHENTICATED, "not registered")


def test_stale_or_future_signed_get_round_is_refused(federation, submitted):
    key, cid = submitted
    for skew in (-3600, 3600):
        _refused(lambda: federation.stub.GetRound(get_round_request(key, cid, now=time.time() + skew)),
                 grpc.StatusCode.UNAUTHENTICATED, "clock")
    huge = get_round_request(key, cid)
    huge.signed_at_unix = (1 << 64) - 1  # out of any window (and the signature no longer matches)
    _refused(lambda: federation.stub.GetRound(huge), grpc.StatusCode.UNAUTHENTICATED, "")
    assert federation.stub.GetRound(get_round_request(key, cid, now=time.time() - 60)).you_submitted  # small skew


def _modes(root: Path) -> dict[str, int]:
    """relative path -> permission bits of the directory and everything in it."""
    out = {".": stat.S_IMODE(root.stat().st_mode)}
    for p in root.rglob("*"):
        if not p.is_symlink():
            out[str(p.relative_to(root))] = stat.S_IMODE(p.stat().st_mode)
    return out


def _assert_private(root: Path) -> None:
    loose = {name: oct(mode) for name, mode in _modes(root).items()
             if mode != (0o700 if (root / name).is_dir() else 0o600)}
    assert not loose, f"readable by others (want 0700 directories, 0600 files): {loose}"


def test_fresh_state_directory_is_private(tmp_path):
    root = tmp_path / "state"
    res = CliRunner().invoke(app, ["init", "--state-dir", str(root)])
    assert res.exit_code == 0, res.output
    assert (root / DB_FILE).is_file() and (root / "state.json").is_file()
    _assert_private(root)


def test_database_stays_private_after_a_round_is_served(federation):
    for seed in range(2):  # min_contributors = 2
        key, cid = federation.register()
        federation.submit(key, cid, codec.encode(federation.small_delta(seed=seed), codec="fp16"))
    federation.wait_published(1)
    root = federation.state.root
    assert (root / f"{DB_FILE}-wal").exists()  # SQLite in WAL mode: the log holds rows too
    modes = _modes(root)
    for name in (".", "blobs", "work"):
        assert modes[name] == 0o700, (name, oct(modes[name]))
    for name in (DB_FILE, f"{DB_FILE}-wal", f"{DB_FILE}-shm", "state.json", "server_key.pem"):
        assert modes[name] == 0o600, (name, oct(modes[name]))
    assert all(modes[name] == 0o600 for name in modes if name.startswith("blobs/sha256/") and (root / name).is_file())


def test_serve_tightens_an_existing_state_directory(federation):
    root = federation.state.root  # an in-process federation holds no lock: serve's open below can take it
    federation.rounds.stop()  # nothing writes into the directory (a round manager prepares its base): as serve finds it
    root.chmod(0o755)
    for p in root.rglob("*"):
        p.chmod(0o755 if p.is_dir() else 0o644)
    state = open_state(root, exclusive=True)  # what `gym-server serve` opens it with
    try:
        _assert_private(root)
    finally:
        state.lock.release()
        state.engine.dispose()
