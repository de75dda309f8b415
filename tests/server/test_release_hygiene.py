"""Issue 18 item 3: what a person meets first. Settings errors name the key, the type it needs and the closest
valid key; `gym-client rewards` against a server that is not there says so; the distribution declares its
license in the SPDX form and ships the text."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from typer.testing import CliRunner

from zoo_gym.client.cli import app as client_app
from zoo_gym.server.cli import app as server_app
from zoo_gym.server.config import ConfigError, build_config

ROOT = Path(__file__).resolve().parents[2]


def _serve_with(tmp_path: Path, text: str):
    cfg = tmp_path / "fed.toml"
    cfg.write_text(text)
    return CliRunner().invoke(server_app, ["serve", "--state-dir", str(tmp_path / "nope"), "--insecure",
                                           "--config", str(cfg)])


def test_a_value_of_the_wrong_type_names_the_key_and_the_type(tmp_path):
    res = _serve_with(tmp_path, 'min-contributors = "two"\n')
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert "`min_contributors` must be an integer, got 'two' (str)" in res.output
    with pytest.raises(ConfigError, match="`trim_beta` must be a number"):
        build_config({"trim-beta": "0.2"})
    with pytest.raises(ConfigError, match="`insecure` must be true or false"):
        build_config({"insecure": "yes"})
    assert build_config({"round-timeout": 600, "quorum": None}).round_timeout == 600  # an int is a number


@pytest.mark.parametrize("typo, meant", [("min_contributers", "min_contributors"), ("agregator", "aggregator"),
                                         ("reward-pol", "reward_pool"), ("dp_clipp", "dp_clip")])
def test_a_typo_suggests_the_closest_valid_key_of_any_part(tmp_path, typo, meant):
    res = _serve_with(tmp_path, f"{typo} = 2\n")
    assert res.exit_code == 2 and res.output.count("\n") == 1, res.output
    assert f"did you mean `{meant}`?" in res.output
    assert "round_timeout" in res.output and "reputation_alpha" in res.output  # all valid keys, not only rewards'


def test_rewards_against_an_unreachable_server_says_unreachable(tmp_path):
    key = tmp_path / "key.pem"
    key.write_bytes(Ed25519PrivateKey.generate().private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    res = CliRunner().invoke(client_app, ["rewards", "--server", f"127.0.0.1:{port}", "--insecure", "--key", str(key)])
    assert res.exit_code == 1 and res.output.count("\n") == 1, res.output
    assert f"the server at 127.0.0.1:{port} is unreachable" in res.output and "refused" not in res.output.split(":")[0]


def test_the_license_is_an_spdx_string_with_its_text_shipped():
    if sys.version_info >= (3, 11):
        import tomllib
    else:
        import tomli as tomllib
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    assert not any(c.startswith("License ::") for c in project.get("classifiers", []))
    text = (ROOT / "LICENSE").read_text()
    assert "Apache License" in text and "Version 2.0, January 2004" in text and "END OF TERMS AND CONDITIONS" in text
