"""Real gym-server and gym-client processes for the end-to-end tests: one way to start them (a TLS server
from a config file included), read the server's status and wait on a condition, so every e2e module runs
the programs the same way a user does."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from zoo_gym.proto.tls import make_certificates

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def chromium() -> str:
    """Debian's headless browser for the browser tests: CI installs it (.ci/run), so there it must be present."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if os.environ.get("CI") == "true":
            pytest.fail("chromium is not installed: .ci/run installs Debian's chromium package for this test")
        pytest.skip("chromium is not installed (apt-get install chromium)")
    return found


def server_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "zoo_gym.server", *args]


def client(root: Path, name: str, port: int | str, *, rounds: int, steps: int | str, shard: int,
           extra: tuple[str, ...] = ()) -> subprocess.Popen:
    """A contributor over TLS: it trusts the federation's private CA (root/tls/ca.pem); `extra`: more flags.
    `port`: the server's on 127.0.0.1, or a whole --server value (several addresses)."""
    work = root / name
    work.mkdir(exist_ok=True)
    server = port if isinstance(port, str) else f"127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "zoo_gym.client", "join", "--server", server,
           "--root-certificates", str(root / "tls" / "ca.pem"), "--rounds", str(rounds),
           "--shard", str(shard), "--n-shards", "8", "--workdir", str(work), "--key", str(work / "key.pem"),
           "--max-steps", str(steps), "--threads", "1", "--quiet", "--json", "--name", name, *extra]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(work / "client.log", "w"), env=ENV, text=True)


def serve_tls(root: Path, state_dir: Path, *args: str, env: dict = ENV,
              timeout: float = 120) -> tuple[subprocess.Popen, int]:
    """`gym-server serve` of `state_dir` over TLS, its certificate from a private CA made in root/tls, with `args`
    (stderr in root/server.log): (process, port) once it listens. One that did not come up is stopped, and
    AssertionError says why."""
    tls = make_certificates(root / "tls", hosts=("127.0.0.1", "localhost"))
    port_file = root / "port"
    server = subprocess.Popen(server_cmd("serve", "--state-dir", str(state_dir), "--port", "0", "--port-file",
                                         str(port_file), "--ssl-certfile", str(tls.cert), "--ssl-keyfile",
                                         str(tls.key), *args),
                              stderr=open(root / "server.log", "w"), env=env)
    try:
        port = wait_for(lambda: port_file.exists() and port_file.read_text().strip() and int(port_file.read_text()),
                        timeout=timeout, what="the server to listen", procs=[server])
    except BaseException:
        stop([server])
        raise
    return server, port


def tls_server(root: Path, config: str, *, db: str | None = None) -> tuple[Path, subprocess.Popen, int]:
    """`gym-server init` (tiny; on the database `db`, default SQLite) in root/server, `config` in root/fed.toml,
    then `serve_tls` with it: (state dir, process, port) once it listens."""
    state_dir = root / "server"
    subprocess.run(server_cmd("init", "--state-dir", str(state_dir), "--base-model", "tiny",
                              *(["--db", db] if db else [])), check=True, env=ENV, capture_output=True)
    (root / "fed.toml").write_text(config)
    server, port = serve_tls(root, state_dir, "--config", str(root / "fed.toml"))
    return state_dir, server, port


def join_summaries(root: Path, clients: dict[str, subprocess.Popen], *, timeout: float) -> dict[str, dict]:
    """Each client's first round summary (`join --json`) once it exits; AssertionError with the tail of its log
    (root/NAME/client.log) when one fails."""
    out = {}
    for name, p in clients.items():
        text, _ = p.communicate(timeout=timeout)
        assert p.returncode == 0, (root / name / "client.log").read_text()[-3000:]
        out[name] = json.loads(text)[0]
    return out


def published_round(state_dir: Path, round_id: int, *, timeout: float, procs=()) -> dict:
    """Round `round_id` of `gym-server status` once it is published."""
    return wait_for(lambda: [r for r in status(state_dir)["rounds"] if r["id"] == round_id
                             and r["state"] == "published"], timeout=timeout,
                    what=f"round {round_id} to be published", procs=procs)[0]


def status(state_dir: Path) -> dict:
    out = subprocess.run(server_cmd("status", "--state-dir", str(state_dir), "--json"), capture_output=True,
                         text=True, check=True, env=ENV)
    return json.loads(out.stdout)


def open_round(port: int, ca: Path) -> int:
    """The id of the round the server has open (gym-demo's GetRound probe; 0 while it does not answer). A cheap
    probe to poll while rounds run: `status` starts a process that imports the server (about a CPU second each
    time, taken from the processes under test), so a wait asks it only once this probe says the rounds awaited
    have closed."""
    from zoo_gym.demo import round_probe

    probe = round_probe(port, ca)
    return probe[0] if probe else 0


def wait_for(predicate, *, timeout: float, what: str, procs=(), poll: float = 1.0):
    """predicate()'s first truthy value; AssertionError when a process in `procs` fails or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        for p in procs:
            if p.poll() not in (None, 0):
                raise AssertionError(f"a process exited with {p.returncode} while waiting for {what}")
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(procs) -> None:
    """Terminate the processes still running, then kill any that has not exited 30 s later."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=30)
