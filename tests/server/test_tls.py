"""TLS by default: plaintext only when both sides ask for it, and every mismatch said at once in one line."""

from __future__ import annotations

import time

import pytest
from typer.testing import CliRunner

from zoo_gym.client.cli import app as client_app
from zoo_gym.client.connection import TransportMismatch, open_stub, with_retries
from zoo_gym.proto import gym_pb2
from zoo_gym.proto.tls import make_certificates
from zoo_gym.server.cli import app as server_app


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tls")
    return make_certificates(root / "ours"), make_certificates(root / "stranger")


def _get_round(address, **transport):
    channel, stub = open_stub(address, **transport)
    try:
        return with_retries(lambda: stub.GetRound(gym_pb2.GetRoundRequest(), timeout=10), what="GetRound",
                            say=lambda _: None, max_wait=60)
    finally:
        channel.close()


def test_serve_without_certificates_or_insecure_refuses_in_one_line(tmp_path):
    from zoo_gym.server.genesis import init_state

    init_state(tmp_path / "s").engine.dispose()
    res = CliRunner().invoke(server_app, ["serve", "--state-dir", str(tmp_path / "s"), "--port", "0"])
    assert res.exit_code == 2
    assert "--ssl-certfile" in res.output and "--insecure" in res.output and "Traceback" not in res.output
    both = CliRunner().invoke(server_app, ["serve", "--state-dir", str(tmp_path / "s"), "--port", "0", "--insecure",
                                           "--ssl-certfile", "x.pem", "--ssl-keyfile", "x.key"])
    assert both.exit_code == 2 and "contradict" in both.output


def test_tls_server_answers_trusting_clients_and_refuses_the_rest_at_once(federation_with, certs):
    ours, stranger = certs
    fed = federation_with(insecure=False, ssl_certfile=str(ours.cert), ssl_keyfile=str(ours.key))
    address = f"127.0.0.1:{fed.port}"
    assert _get_round(address, root_certificates=str(ours.ca)).round_id == 1
    assert _get_round(f"localhost:{fed.port}", root_certificates=str(ours.ca)).round_id == 1
    for transport, says in (({"insecure": True}, "serves TLS"),
                            ({"root_certificates": str(stranger.ca)}, "certificate does not verify"),
                            ({}, "certificate does not verify")):  # system trust store: our private CA is not in it
        started = time.monotonic()
        with pytest.raises(TransportMismatch, match=says):
            _get_round(address, **transport)
        assert time.monotonic() - started < 30  # not retried for the whole 60 s budget


def test_tls_client_against_a_plaintext_server_is_told_to_use_insecure(federation, certs):
    with pytest.raises(TransportMismatch, match="does not speak TLS"):
        _get_round(f"127.0.0.1:{federation.port}", root_certificates=str(certs[0].ca))
    assert _get_round(f"127.0.0.1:{federation.port}", insecure=True).round_id == 1


def test_client_cli_over_tls_and_its_one_line_refusal(federation_with, certs, tmp_path):
    ours, _ = certs
    fed = federation_with(insecure=False, ssl_certfile=str(ours.cert), ssl_keyfile=str(ours.key))
    args = ["rewards", "--server", f"127.0.0.1:{fed.port}", "--contributor", "0" * 32, "--json"]
    ok = CliRunner().invoke(client_app, [*args, "--root-certificates", str(ours.ca)])
    assert ok.exit_code == 0, ok.output
    refused = CliRunner().invoke(client_app, args)
    assert refused.exit_code == 1 and "--root-certificates" in refused.output
    assert len([line for line in refused.output.splitlines() if line.strip()]) == 1
    pull = CliRunner().invoke(client_app, ["pull", str(tmp_path / "m"), "--server", f"127.0.0.1:{fed.port}",
                                           "--insecure", "--workdir", str(tmp_path / "w")])
    assert pull.exit_code == 1 and "serves TLS" in pull.output
