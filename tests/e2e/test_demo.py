"""`gym-demo`, the README's main job, run as a user runs it: a real server and real clients over TLS, a
table per round with the held-out loss going down, the dashboard URL, and with --keep a server that keeps
serving its dashboard until it is told to stop."""

from __future__ import annotations

import json
import os
import re
import signal
import ssl
import subprocess
import sys
import time
import urllib.request

DEMO = [sys.executable, "-c", "from zoo_gym.demo import app; app(prog_name='gym-demo')"]


def test_demo_with_two_clients_publishes_a_better_checkpoint_and_keeps_serving(tmp_path):
    work = tmp_path / "demo"
    proc = subprocess.Popen([*DEMO, "--rounds", "1", "--clients", "2", "--max-steps", "2", "--keep",
                             "--workdir", str(work)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines: list[str] = []
    try:
        deadline = time.monotonic() + 420
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line:
                break
            lines.append(line.rstrip())
            if "keeps serving" in line:
                break
        out = "\n".join(lines)
        assert "keeps serving" in out, out
        assert "too few for the robust default" in out  # 2 contributors: said, and merged with the mean
        loss = re.search(r"held-out loss ([0-9.]+) -> ([0-9.]+) over 1 rounds", out)
        assert loss and float(loss.group(2)) < float(loss.group(1)), out
        url = re.search(r"dashboard: (https://127\.0\.0\.1:\d+/)", out).group(1)
        ctx = ssl.create_default_context(cafile=str(work / "tls" / "ca.pem"))
        with urllib.request.urlopen(url + "api/summary", context=ctx, timeout=10) as resp:
            summary = json.load(resp)
        # the dashboard still answers after the last round, with the round the table showed
        assert summary["rounds_published"] == 1 and summary["contributors"] == 2
        assert abs(summary["last_heldout_loss"] - float(loss.group(2))) < 1e-3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_demo_says_in_one_line_why_the_server_did_not_start(tmp_path):
    result = subprocess.run([*DEMO, "--rounds", "1", "--clients", "2", "--aggregator", "krum",
                             "--workdir", str(tmp_path / "demo")], capture_output=True, text=True, timeout=300)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    error = [ln for ln in result.stderr.splitlines() if ln.startswith("error:")]
    assert len(error) == 1 and "gym-server did not start" in error[0] and "krum" in error[0], result.stderr
