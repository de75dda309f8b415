"""gym-client as a person meets it: clear one-line errors, retries that say so, --help that explains."""

from __future__ import annotations

import socket

import grpc
import pytest
from typer.testing import CliRunner

from zoo_gym.client.cli import app
from zoo_gym.client.connection import Servers, ServerUnreachable, open_stub, spread, with_retries
from zoo_gym.proto import gym_pb2, signing


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


def test_a_closed_socket_is_a_tls_mismatch_at_first_contact_only():
    """A TLS server answers a plaintext client by closing the socket; so does a server killed in the middle of
    a call ('Stream removed (Socket closed)'), which a client that already spoke to it retries."""
    from zoo_gym.client.connection import TransportMismatch

    class Closed(grpc.RpcError):
        def code(self):
            return grpc.StatusCode.UNAVAILABLE

        def details(self):
            return "Stream removed (Socket closed)"

    calls = []

    def call():
        calls.append(1)
        if len(calls) < 3:
            raise Closed()
        return "taken"

    with pytest.raises(TransportMismatch, match="drop --insecure"):
        with_retries(call, what="x", say=lambda _m: None, max_wait=5)
    calls.clear()
    assert with_retries(call, what="x", say=lambda _m: None, max_wait=30, base_delay=0.01,
                        first_contact=False) == "taken" and len(calls) == 3


@pytest.mark.parametrize("args, message", [
    (["--method", "dpo"], "--method must be one of"), (["--stage", "ppo2"], "`stage` must be one of"),
    (["--codec", "zip"], "--codec must be one of"),
    (["--data", "/nonexistent/data.jsonl"], "no such file"),
    (["--server", "127.0.0.1:2,127.0.0.1:1"], "--server names 127.0.0.1:1 twice"),
    (["--server", "127.0.0.1:2,localhost"], "give HOST:PORT"),
])
def test_bad_options_exit_2_with_one_line(args, message, tmp_path):
    res = CliRunner().invoke(app, ["join", "--server", "127.0.0.1:1", "--workdir", str(tmp_path), *args])
    assert res.exit_code == 2 and message in res.output and "Traceback" not in res.output


def test_help_explains_join():
    res = CliRunner().invoke(app, ["join", "--help"])
    assert res.exit_code == 0
    for flag in ("--server", "--data", "--method", "--rounds", "--key", "--workdir", "--codec"):
        assert flag in res.output


def test_join_takes_several_addresses_comma_separated_or_repeated(tmp_path):
    res = CliRunner().invoke(app, ["join", "--server", "127.0.0.1:1, 127.0.0.1:2", "--server", "[::1]:3",
                                   "--workdir", str(tmp_path), "--dry-run"])
    assert res.exit_code == 0, res.output


def test_keys_spread_over_the_addresses_and_each_keeps_its_own():
    from collections import Counter

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    keys = [signing.public_bytes(Ed25519PrivateKey.from_private_bytes(bytes([i]) * 32)) for i in range(1, 241)]
    counts = Counter(spread(k, 3) for k in keys)
    assert sorted(counts) == [0, 1, 2] and min(counts.values()) >= 50  # 80 each on average
    assert [spread(k, 3) for k in keys] == [spread(k, 3) for k in keys] and {spread(k, 1) for k in keys} == {0}


def test_an_unavailable_address_moves_its_contributor_to_the_next(tmp_path):
    """Unary and streamed calls alike: the outage is raised, the next address answers the retry; a refusal
    leaves the address as it was."""
    from zoo_gym.server.config import build_config
    from zoo_gym.server.genesis import init_state
    from zoo_gym.server.transport.servicer import build_server

    state = init_state(tmp_path / "state", base_model="tiny")
    server, port, _ = build_server(state, build_config({}, port=0, insecure=True))
    server.start()
    live, said = f"127.0.0.1:{port}", []
    servers = Servers([f"127.0.0.1:{_closed_port()}", live], insecure=True, say=said.append)
    try:
        info = with_retries(lambda: servers.GetRound(gym_pb2.GetRoundRequest(), timeout=5), what="get round",
                            say=said.append, max_wait=60, base_delay=0.1)
        assert info.round_id == 1 and servers.address == live
        assert said[0].endswith(f"answered UNAVAILABLE: going on with {live}")
        with pytest.raises(grpc.RpcError) as refused:
            servers.GetRound(gym_pb2.GetRoundRequest(contributor_id="not-an-id"), timeout=5)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and servers.address == live
        servers.index = 0  # a download from the unavailable address first
        request = gym_pb2.DownloadRequest(checkpoint_sha256=info.base_sha256)
        chunks = with_retries(lambda: list(servers.DownloadCheckpoint(request, timeout=30)), what="download",
                              say=said.append, max_wait=60, base_delay=0.1)
        assert sum(len(c.data) for c in chunks) == info.base_size and servers.address == live
    finally:
        servers.close()
        server.stop(grace=None)
        state.engine.dispose()
