"""`gym-server status` and `gym-server --help` import no training stack (issue 30: status took 97 s of wall
time on a loaded machine, most of it importing torch): run in a fresh interpreter, neither leaves torch,
transformers or trl in sys.modules. And the serving modules leave out the privacy accountant until a figure is
asked for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from zoo_gym.server.genesis import init_state

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "trl", "opacus", "numba")
WRAPPER = """
import json, sys
from zoo_gym.server.cli import app
try:
    app(sys.argv[1:], prog_name="gym-server")
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "heavy": sorted(m for m in %r if m in sys.modules)}))
""" % (HEAVY,)


def _run(*args: str) -> tuple[dict, str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", WRAPPER, *args], capture_output=True, text=True, env=env,
                         timeout=120, check=True).stdout
    return json.loads(out.strip().splitlines()[-1]), out


@pytest.fixture(scope="module")
def state_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("light") / "state"
    init_state(root, base_model="tiny")
    return root


@pytest.mark.parametrize("args", [("status",), ("status", "--json"), ("--help",), ("status", "--help")])
def test_status_and_help_do_not_import_the_training_stack(state_dir, args):
    if args[0] == "status" and "--help" not in args:
        args = (*args, "--state-dir", str(state_dir))
    doc, out = _run(*args)
    assert doc["code"] in (0, None), out
    assert doc["heavy"] == [], f"{' '.join(args)} imported {doc['heavy']}"
    if args == ("status", "--state-dir", str(state_dir)):
        assert "round 1: open" in out


def test_a_server_without_differential_privacy_does_not_load_the_accountant():
    """Opacus (and the scipy it brings) is ~110 MB of resident memory in every `gym-server serve` process; only
    a privacy figure needs it, so the serving modules import it on first use, and a figure still comes out."""
    code = """
import json, sys
import zoo_gym.server.rounds.manager, zoo_gym.server.transport.servicer, zoo_gym.server.rounds.publish
before = "opacus" in sys.modules
from zoo_gym.aggregation.privacy import PrivacyAccountant
acct = PrivacyAccountant()
acct.step(noise_multiplier=1.0, sample_rate=0.1)
print(json.dumps({"before": before, "eps": acct.epsilon(delta=1e-5), "after": "opacus" in sys.modules}))
"""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300,
                         check=True).stdout
    doc = json.loads(out.strip().splitlines()[-1])
    assert doc["before"] is False
    assert 0 < doc["eps"] < 10 and doc["after"] is True
