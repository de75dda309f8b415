"""gym-client as a person meets it: clear one-line errors, retries that say so, --help that explains."""

from __future__ import annotations

import socket

import grpc
import pytest
from typer.testing import CliRunner

from zoo_gym.client.cli import app
from zoo_gym.client.connection import ServerUnreachable, open_stub, with_retries
from zoo_gym.proto import gym_pb2


def _closed_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now
    return port


def test_unreachable_server_is_retried_with_backoff_and_said(tmp_path):
    said: list[str] = []
    channel, stub = open_stub(f"127.0.0.1:{_closed_port()}")
    with pytest.raises(ServerUnreachable, match="unreachable"):
        with_retries(lambda: stub.GetRound(gym_pb2.GetRoundRequest(), timeout=1), what="get round",
                     say=said.append, max_wait=2.0, base_delay=0.2)
    channel.close()
    assert said and all("retrying in" in line for line in said)


def test_refusals_are_not_retried():
    calls = []

    class Refused(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.INVALID_ARGUMENT

    def call():
        calls.append(1)
        raise Refused()

    with pytest.raises(Refused):
        with_retries(call, what="x", say=print, max_wait=5)
    assert len(calls) == 1


@pytest.mark.parametrize("args, message", [
    (["--method", "dpo"], "--method must be one of"), (["--stage", "ppo2"], "`stage` must be one of"),
    (["--codec", "zip"], "--codec must be one of"),
    (["--data", "/nonexistent/data.jsonl"], "no such file"),
])
def test_bad_options_exit_2_with_one_line(args, message, tmp_path):
    res = CliRunner().invoke(app, ["join", "--server", "127.0.0.1:1", "--workdir", str(tmp_path), *args])
    assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output


def test_help_explains_join():
    res = CliRunner().invoke(app, ["join", "--help"])
    assert res.exit_code == 0
    for flag in ("--server", "--data", "--method", "--rounds", "--key", "--workdir", "--codec"):
        assert flag in res.output
