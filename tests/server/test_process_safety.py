"""One server per port, one per state directory, a state directory that can move, one-line CLI errors.

The port and state-directory cases run real `gym-server serve` processes on 127.0.0.1 (a second server
used to start, print "listening" and split the clients with the first: grpcio sets SO_REUSEPORT, and
nothing locked the state directory).
"""

from __future__ import annotations

import json
import os
import shutil
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from typer.testing import CliRunner

from zoo_gym.server.cli import app
from zoo_gym.server.genesis import init_state
from server_processes import stop

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def _gym_server(*args: str) -> list[str]:
    return [sys.executable, "-m", "zoo_gym.server", *args]


def _init(state_dir: Path) -> Path:
    init_state(state_dir, base_model="tiny").engine.dispose()
    return state_dir


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


def _cli(*args: str):
    return CliRunner().invoke(app, list(args))


def _serving(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        try:
            resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        except grpc.RpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def _second_serve(tmp_path: Path, *args: str) -> tuple[int, str]:
    """A second `gym-server serve` that must refuse at once: (exit code, stderr). One that prints
    "listening" or is still running after 120 s is killed and fails the test."""
    log = tmp_path / "second.log"
    with open(log, "w") as err:
        proc = subprocess.Popen(_gym_server("serve", "--insecure", *args), stdout=subprocess.DEVNULL, stderr=err,
                                env=ENV)
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None:
            if "listening" in log.read_text() or time.monotonic() > deadline:
                raise AssertionError(f"the second server started instead of refusing:\n{log.read_text()[-2000:]}")
            time.sleep(0.2)
        return proc.returncode, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


@pytest.fixture(scope="module")
def running(tmp_path_factory):
    """One real `gym-server serve` on 127.0.0.1 over its own state directory: (process, port, state dir)."""
    root = tmp_path_factory.mktemp("running")
    state_dir = _init(root / "state")
    port_file = root / "port"
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(_gym_server("serve", "--insecure", "--state-dir", str(state_dir), "--host", "127.0.0.1",
                                        "--port", "0",
                                        "--port-file", str(port_file)), stderr=log, env=ENV)
    try:
        deadline = time.monotonic() + 120
        while not (port_file.exists() and port_file.read_text().strip()):
            assert proc.poll() is None, (root / "server.log").read_text()[-2000:]
            assert time.monotonic() < deadline, "the server did not write its port within 120 s"
            time.sleep(0.2)
        yield proc, int(port_file.read_text()), state_dir
    finally:
        stop(proc)
        log.close()


def test_a_second_server_on_a_port_in_use_fails_in_one_line(running, tmp_path):
    first, port, _ = running
    other = _init(tmp_path / "other")
    code, stderr = _second_serve(tmp_path, "--state-dir", str(other), "--host", "127.0.0.1", "--port", str(port))
    assert code == 2, stderr[-2000:]
    lines = _error_lines(stderr)
    assert len(lines) == 1 and lines[0].startswith(f"error: port {port} is already in use"), stderr[-2000:]
    assert first.poll() is None and _serving(port)  # the first server still owns the port alone


def test_a_second_server_on_the_same_state_dir_names_the_first_ones_pid(running, tmp_path):
    first, _, state_dir = running
    code, stderr = _second_serve(tmp_path, "--state-dir", str(state_dir), "--host", "127.0.0.1", "--port", "0")
    assert code == 2, stderr[-2000:]
    lines = _error_lines(stderr)
    assert len(lines) == 1 and lines[0].startswith("error: ") and f"PID {first.pid}" in lines[0], stderr[-2000:]
    assert (state_dir / "server.lock").read_text().strip() == str(first.pid)
    assert first.poll() is None


def test_read_only_commands_work_while_a_server_runs_and_leave_its_uploads_alone(running):
    first, _, state_dir = running
    upload = state_dir / "blobs" / "tmp" / "blob-in-flight"  # an upload the running server is receiving
    upload.write_bytes(b"half a delta")
    try:
        for args in (["status"], ["status", "--json"], ["ledger", "show"], ["ledger", "verify"]):
            res = _cli(*args, "--state-dir", str(state_dir))
            assert res.exit_code == 0, (args, res.output)
        assert json.loads(_cli("status", "--state-dir", str(state_dir), "--json").output)["round"]["id"] == 1
        assert upload.exists()
    finally:
        upload.unlink(missing_ok=True)
    assert first.poll() is None


def test_a_killed_server_leaves_no_lock_behind(tmp_path):
    from zoo_gym.server.store.state import StateError, open_state

    state_dir = _init(tmp_path / "fed")
    script = "import sys, time; from zoo_gym.server.store.state import open_state; " \
             "s = open_state(sys.argv[1], exclusive=True); time.sleep(300)"
    holder = subprocess.Popen([sys.executable, "-c", script, str(state_dir)], env=ENV)
    try:
        lock = state_dir / "server.lock"
        deadline = time.monotonic() + 60
        while not (lock.exists() and lock.read_text().strip() == str(holder.pid)):
            assert holder.poll() is None and time.monotonic() < deadline, "the holder did not take the lock"
            time.sleep(0.1)
        with pytest.raises(StateError, match=f"PID {holder.pid}"):
            open_state(state_dir, exclusive=True)
    finally:
        holder.kill()  # as a crash would: no clean-up runs
        holder.wait(timeout=30)
    state = open_state(state_dir, exclusive=True)  # the kernel dropped the dead holder's lock
    try:
        assert lock.read_text().strip() == str(os.getpid())
    finally:
        state.lock.release()
        state.engine.dispose()


def _set_round_message(state_dir: Path, message: str) -> None:
    with sqlite3.connect(state_dir / "server.db") as db:
        db.execute("UPDATE round SET message = ? WHERE id = 1", (message,))


def test_a_copied_or_moved_state_directory_uses_its_own_database(tmp_path):
    original = _init(tmp_path / "fed")
    assert json.loads((original / "state.json").read_text())["db_url"] is None  # no absolute path stored
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    _set_round_message(copy, "edited in the copy")
    res = _cli("status", "--state-dir", str(copy))
    assert res.exit_code == 0 and "edited in the copy" in res.output, res.output
    assert "edited in the copy" not in _cli("status", "--state-dir", str(original)).output

    moved = tmp_path / "elsewhere" / "fed"
    moved.parent.mkdir()
    original.rename(moved)
    res = _cli("status", "--state-dir", str(moved), "--json")
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["round"]["id"] == 1 and "edited in the copy" not in res.output
    assert not original.exists()  # nothing recreated at the old place


def test_an_old_state_json_with_an_absolute_database_path_keeps_working(tmp_path):
    original = _init(tmp_path / "fed")
    meta = json.loads((original / "state.json").read_text())
    # what `gym-server init` wrote before: init's default database, as an absolute path
    meta["db_url"] = f"sqlite:///{(original / 'server.db').resolve()}"
    (original / "state.json").write_text(json.dumps(meta))
    assert _cli("status", "--state-dir", str(original)).exit_code == 0
    copy = tmp_path / "copy"
    shutil.copytree(original, copy)
    _set_round_message(copy, "edited in the copy")
    assert "edited in the copy" in _cli("status", "--state-dir", str(copy)).output  # its own, not the original's
    assert "edited in the copy" not in _cli("status", "--state-dir", str(original)).output

    # an explicit --db chosen at init (a database outside the state directory) is still honoured
    outside = tmp_path / "outside"
    outside.mkdir()
    (original / "server.db").rename(outside / "chosen.db")
    for suffix in ("-wal", "-shm"):
        if (original / f"server.db{suffix}").exists():
            (original / f"server.db{suffix}").rename(outside / f"chosen.db{suffix}")
    meta["db_url"] = f"sqlite:///{(outside / 'chosen.db').resolve()}"
    (original / "state.json").write_text(json.dumps(meta))
    res = _cli("status", "--state-dir", str(original), "--json")
    assert res.exit_code == 0 and json.loads(res.output)["round"]["id"] == 1, res.output


def _assert_one_line_error(res, *needles: str) -> None:
    lines = _error_lines(res.output)
    assert res.exit_code == 2, (res.exit_code, res.output, res.exception)
    assert len(lines) == 1 and lines[0].startswith("error: "), res.output
    for needle in needles:
        assert needle in lines[0], res.output


@pytest.mark.parametrize("command", [["status"], ["status", "--json"], ["ledger", "show"], ["ledger", "verify"],
                                     ["serve", "--port", "0"]])
def test_every_command_on_a_missing_state_dir_fails_in_one_line(command, tmp_path):
    res = _cli(*command, "--state-dir", str(tmp_path / "missing"))
    _assert_one_line_error(res, "is not a gym-server state directory", "gym-server init")
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize("command", [["status"], ["ledger", "show"], ["ledger", "verify"]])
def test_a_state_dir_without_its_database_fails_in_one_line(command, tmp_path):
    state_dir = _init(tmp_path / "fed")
    for p in state_dir.glob("server.db*"):
        p.unlink()
    res = _cli(*command, "--state-dir", str(state_dir))
    _assert_one_line_error(res, "server.db")
    assert not (state_dir / "server.db").exists()  # not silently replaced by an empty database


def test_a_damaged_state_json_fails_in_one_line(tmp_path):
    state_dir = _init(tmp_path / "fed")
    (state_dir / "state.json").write_text("{not json")
    _assert_one_line_error(_cli("status", "--state-dir", str(state_dir)), "state.json")


def test_init_on_a_bad_path_or_database_url_fails_in_one_line(tmp_path):
    (tmp_path / "a-file").write_text("")
    _assert_one_line_error(_cli("init", "--state-dir", str(tmp_path / "a-file" / "fed")))
    _assert_one_line_error(_cli("init", "--state-dir", str(tmp_path / "fed"), "--db", "nonsense:/x"))
    _assert_one_line_error(_cli("init", "--state-dir", str(tmp_path / "fed2"), "--base-model", str(tmp_path / "nope")),
                           "--base-model")
