"""The CLIs' --version, serve's new flags in --help, and the server's log formats."""

from __future__ import annotations

import json
import logging

import pytest
from typer.testing import CliRunner

from zoo_gym import __version__
from zoo_gym.client.cli import app as client_app
from zoo_gym.server.cli import app as server_app
from zoo_gym.server.logging_setup import configure_logging

runner = CliRunner()


@pytest.mark.parametrize("app,name", [(server_app, "gym-server"), (client_app, "gym-client")])
def test_version(app, name):
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"{name} {__version__}"


def test_serve_help_shows_the_new_flags_and_their_defaults():
    result = runner.invoke(server_app, ["serve", "--help"], env={"COLUMNS": "2000"})
    text = " ".join(result.output.split())
    assert "--dashboard-port" in text and "0 = off" in text and "[default: 0;" in text
    assert "--log-format" in text and "[default: text;" in text


def test_a_bad_log_format_is_one_line(tmp_path):
    result = runner.invoke(server_app, ["serve", "--state-dir", str(tmp_path), "--insecure", "--log-format", "xml"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == ["error: `log_format` must be text or json, got 'xml'"]


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    server_level = logging.getLogger("zoo_gym.server").level
    yield
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in handlers:
        root.addHandler(h)
    root.setLevel(level)
    logging.getLogger("zoo_gym.server").setLevel(server_level)


def test_json_log_lines_carry_the_events_fields(restore_logging, capsys):
    configure_logging(level="WARNING", fmt="json")
    log = logging.getLogger("zoo_gym.server")
    log.info("submission refused: nope", extra={"event": "submission", "code": "UNAUTHENTICATED"})
    log.warning("submission refused: %s", "bad signature", extra={"event": "submission", "code": "UNAUTHENTICATED"})
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1  # INFO is below the chosen level; the server's logger still makes the record
    doc = json.loads(lines[0])
    assert doc["message"] == "submission refused: bad signature" and doc["level"] == "WARNING"
    assert doc["event"] == "submission" and doc["code"] == "UNAUTHENTICATED" and doc["logger"] == "zoo_gym.server"
    assert log.isEnabledFor(logging.INFO)  # the phase timer still sees publish phases at --log-level WARNING
