"""A real `gym-server serve --log-format json` process: every line it writes to stderr is one JSON object
(its own announcements and uvicorn's records included, no ANSI colour), and its /metrics has the process
and platform series and an RPC latency histogram by method and code (issue 30)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from zoo_gym.server.genesis import init_state
from server_processes import stop

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "FORCE_COLOR": "1",
       "PYTHONPATH": f"{Path(__file__).resolve().parents[2]}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _scrape(url: str) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(url, timeout=10) as r:
        text = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_json_log_lines_and_metrics_of_a_real_server(tmp_path):
    state_dir = tmp_path / "state"
    init_state(state_dir, base_model="tiny").engine.dispose()
    port_file, dash_port, log_path = tmp_path / "port", _free_port(), tmp_path / "server.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "zoo_gym.server", "serve", "--insecure", "--state-dir",
                                 str(state_dir), "--host", "127.0.0.1", "--port", "0", "--port-file", str(port_file),
                                 "--dashboard-port", str(dash_port), "--log-format", "json"],
                                stdout=subprocess.DEVNULL, stderr=log, env=ENV)
    try:
        deadline = time.monotonic() + 120
        while not (port_file.exists() and port_file.read_text().strip()):
            assert proc.poll() is None, log_path.read_text()[-2000:]
            assert time.monotonic() < deadline, "the server did not write its port within 120 s"
            time.sleep(0.2)
        port = int(port_file.read_text())
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
            for _ in range(3):
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""), timeout=10)
        while True:
            try:
                m = _scrape(f"http://127.0.0.1:{dash_port}/metrics")
                break
            except OSError:
                assert time.monotonic() < deadline and proc.poll() is None, log_path.read_text()[-2000:]
                time.sleep(0.2)
    finally:
        stop(proc)

    assert m[("process_cpu_seconds_total", ())] > 0 and m[("process_resident_memory_bytes", ())] > 0
    assert any(name == "python_info" for name, _ in m)
    check = (("code", "OK"), ("method", "Check"))
    assert m[("zoo_gym_rpc_seconds_count", check)] == 3
    assert 0 < m[("zoo_gym_rpc_seconds_sum", check)] < 30
    assert m[("zoo_gym_rpc_seconds_bucket", (*check[:1], ("le", "+Inf"), *check[1:]))] == 3

    lines = log_path.read_text().splitlines()
    assert lines, "the server wrote nothing"
    docs = []
    for line in lines:
        assert "\x1b" not in line, line
        try:
            doc = json.loads(line)
        except ValueError:
            raise AssertionError(f"not a JSON line: {line!r}") from None
        assert isinstance(doc, dict) and {"time", "level", "logger", "message"} <= set(doc), line
        docs.append(doc)
    messages = [d["message"] for d in docs]
    assert any(t.startswith("gym-server listening on 127.0.0.1:") for t in messages), messages
    assert any(t.startswith("dashboard at http://") for t in messages), messages
    assert any(d["logger"].startswith("uvicorn") for d in docs), messages
    assert messages[-1] == "gym-server stopping" or "gym-server stopping" in messages, messages
