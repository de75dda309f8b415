"""The operator's dashboard is not a public surface (issue 46): it binds loopback by default whatever --host is,
`--dashboard-token-file` puts every route behind a bearer token, and with server DP on a dashboard on another
address without a token is refused in one line, by `serve` and by `gym-server settings`."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from typer.testing import CliRunner

from zoo_gym.proto import gym_pb2, gym_pb2_grpc, signing
from zoo_gym.server.cli import app
from zoo_gym.server.genesis import init_state
from server_processes import stop

DP = ["--aggregator", "mean", "--dp-noise-multiplier", "1", "--dp-clip", "0.05", "--dp-expected-contributors", "3"]
TOKEN = "s3cret-dashboard-token-0123456789"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
       "PYTHONPATH": f"{Path(__file__).resolve().parents[2]}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _refused(tmp_path, args: list[str]) -> list[str]:
    """The output of `settings` and of `serve` given `args`: both must refuse in one line, creating nothing."""
    outputs = []
    for command in (["settings"], ["serve", "--state-dir", str(tmp_path / "fed"), "--insecure"]):
        res = CliRunner().invoke(app, command + args)
        assert res.exit_code != 0 and "Traceback" not in res.output, res.output
        assert len(res.output.strip().splitlines()) == 1, res.output
        outputs.append(res.output)
    assert not (tmp_path / "fed").exists()
    return outputs


def test_dp_with_a_public_dashboard_and_no_token_is_refused_in_one_line(tmp_path):
    for host in ("0.0.0.0", "192.0.2.7", "gym.example.org", "::"):
        for out in _refused(tmp_path, [*DP, "--dashboard-port", "8080", "--dashboard-host", host]):
            assert f"the dashboard on {host} would publish per-contributor figures" in out, out
            assert "--dashboard-host 127.0.0.1" in out and "--dashboard-token-file" in out, out


def test_a_missing_or_short_token_file_is_refused_in_one_line(tmp_path):
    short = tmp_path / "short"
    short.write_text("  too-short-123  \n")  # 13 characters once stripped
    spaced = tmp_path / "spaced"
    spaced.write_text("a token with spaces in it\n")
    for path, says in ((tmp_path / "absent", "cannot read it"), (short, "at least 16"), (spaced, "without spaces")):
        for out in _refused(tmp_path, ["--dashboard-port", "8080", "--dashboard-token-file", str(path)]):
            assert "`dashboard_token_file`" in out and says in out, out


def test_what_is_accepted_and_the_default_host(tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    for args in ([*DP, "--dashboard-port", "8080"],  # loopback by default
                 [*DP, "--dashboard-port", "8080", "--dashboard-host", "::1"],
                 [*DP, "--dashboard-port", "8080", "--dashboard-host", "0.0.0.0", "--dashboard-token-file",
                  str(token_file)],
                 ["--dashboard-port", "8080", "--dashboard-host", "0.0.0.0"]):  # no DP: the ledger is public anyway
        res = CliRunner().invoke(app, ["settings", *args])
        assert res.exit_code == 0, (args, res.output)
    shown = json.loads(CliRunner().invoke(app, ["settings", "--host", "0.0.0.0"]).output)
    assert shown["host"] == "0.0.0.0" and shown["dashboard_host"] == "127.0.0.1"


def _listening(port: int) -> set[str]:
    """The addresses a TCP socket of this machine listens on at `port` (from /proc/net/tcp and tcp6)."""
    found = set()
    for name, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(name).read_text().splitlines()[1:]:
            local, state = line.split()[1], line.split()[3]
            addr, hex_port = local.split(":")
            if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                raw = bytes.fromhex(addr)
                words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))  # each 32-bit word host-order
                found.add(socket.inet_ntop(socket.AF_INET if width == 8 else socket.AF_INET6, words))
    return found


def _get(url: str, token: str | None = None) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.fixture(scope="module")
def dp_server(tmp_path_factory):
    """A real `gym-server serve` with DP on, gRPC on 0.0.0.0, the dashboard on its default host behind a token."""
    root = tmp_path_factory.mktemp("dashboard-access")
    init_state(root / "state", base_model="tiny").engine.dispose()
    token_file, port_file, dash_port, log_path = root / "token", root / "port", _free_port(), root / "server.log"
    token_file.write_text(f"\n  {TOKEN}\n")
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "zoo_gym.server", "serve", "--insecure", "--state-dir",
                                 str(root / "state"), "--host", "0.0.0.0", "--port", "0", "--port-file",
                                 str(port_file), "--dashboard-port", str(dash_port), "--dashboard-token-file",
                                 str(token_file), *DP], stdout=subprocess.DEVNULL, stderr=log, env=ENV)
    try:
        deadline = time.monotonic() + 120
        base = f"http://127.0.0.1:{dash_port}"
        while not (port_file.exists() and port_file.read_text().strip()) or _poll(base) is None:
            assert proc.poll() is None, log_path.read_text()[-2000:]
            assert time.monotonic() < deadline, "the server and its dashboard did not start within 120 s"
            time.sleep(0.2)
        yield {"port": int(port_file.read_text()), "dash_port": dash_port, "base": base, "log": log_path}
    finally:
        stop(proc)


def _poll(base: str) -> int | None:
    try:
        return _get(base + "/api/summary", TOKEN)[0]
    except OSError:
        return None


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads the listening sockets from /proc/net")
def test_the_dashboard_binds_loopback_while_grpc_binds_every_address(dp_server):
    assert _listening(dp_server["dash_port"]) == {"127.0.0.1"}
    assert _listening(dp_server["port"]) & {"0.0.0.0", "::"}
    assert f"dashboard at http://127.0.0.1:{dp_server['dash_port']}/" in dp_server["log"].read_text()


@pytest.mark.parametrize("path", ["/", "/api/summary", "/api/leaderboard", "/metrics", "/api/openapi.json",
                                  "/static/style.css", "/contributors/" + "0" * 32, "/no-such-page"])
def test_every_route_needs_the_token(dp_server, path):
    for token in (None, "wrong-token-of-the-right-kind-0123", TOKEN[:-1], TOKEN + "x"):
        status, body = _get(dp_server["base"] + path, token)
        assert status == 401, (path, token, status)
        assert len(body.decode().splitlines()) == 1 and "token" in json.loads(body)["detail"], body
    request = urllib.request.Request(dp_server["base"] + path, headers={"Authorization": f"Basic {TOKEN}"})
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=10)
    assert refused.value.code == 401 and refused.value.headers["WWW-Authenticate"].startswith("Bearer")
    assert refused.value.headers["Content-Security-Policy"]  # a refusal carries the security headers too


def test_the_right_token_opens_the_pages_the_api_and_metrics(dp_server):
    status, page = _get(dp_server["base"] + "/", TOKEN)
    assert status == 200 and b"<html" in page.lower()
    status, summary = _get(dp_server["base"] + "/api/summary", TOKEN)
    assert status == 200 and json.loads(summary)["current_round"] == 1
    status, metrics = _get(dp_server["base"] + "/metrics", TOKEN)
    assert status == 200 and b"zoo_gym_rpcs_total" in metrics


def test_the_real_server_signs_its_participation_mode(dp_server):
    with grpc.insecure_channel(f"127.0.0.1:{dp_server['port']}") as channel:
        info = gym_pb2_grpc.GymStub(channel).GetRound(gym_pb2.GetRoundRequest(), timeout=30)
    assert info.dp_participation == "public"  # --dp-participation's default
    signing.verify(bytes(info.server_public_key), bytes(info.signature), signing.round_info_bytes(info))
