"""gym-client's address handling: a --server without a port is refused at once, before a key is made;
an unreachable server is named and given up after --connect-timeout, in one line."""

from __future__ import annotations

import socket

import pytest
from typer.testing import CliRunner

from zoo_gym.client.cli import app

runner = CliRunner()


@pytest.mark.parametrize("server", ["localhost", "[::1]", "localhost:0", "localhost:http", "127.0.0.1:70000"])
def test_a_server_without_a_usable_port_is_refused_at_once(tmp_path, server):
    result = runner.invoke(app, ["join", "--server", server, "--insecure", "--workdir", str(tmp_path),
                                 "--key", str(tmp_path / "key.pem")])
    assert result.exit_code == 2
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --server {server!r}: give HOST:PORT")
    assert not (tmp_path / "key.pem").exists()  # refused before anything was made


def test_an_unreachable_server_is_named_and_given_up_after_the_connect_timeout(tmp_path):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = runner.invoke(app, ["join", "--server", f"127.0.0.1:{port}", "--insecure", "--connect-timeout", "2",
                                 "--workdir", str(tmp_path), "--key", str(tmp_path / "key.pem"), "--max-steps", "2",
                                 "--warmup-steps", "0"])
    assert result.exit_code == 1
    last = result.output.strip().splitlines()[-1]
    assert last.startswith(f"error: register at 127.0.0.1:{port}: the server is unreachable")
    assert last.endswith("gave up after 2 s")


def test_report_to_is_a_checked_training_flag(tmp_path):
    import importlib.util

    from zoo_gym.gym_train import TrainConfig
    from zoo_gym.gym_train.config import TrainConfigError

    help_text = " ".join(runner.invoke(app, ["join", "--help"], env={"COLUMNS": "200"}).output.split())
    assert "--report-to" in help_text and "none | tensorboard | wandb" in help_text
    assert TrainConfig(report_to="none").report_to == "none"
    with pytest.raises(TrainConfigError, match="report_to"):
        TrainConfig(report_to="mlflow")
    for name in ("tensorboard", "wandb"):
        if importlib.util.find_spec(name) is None:  # refused with what to install, before any work
            with pytest.raises(TrainConfigError, match=f"pip install {name}"):
                TrainConfig(report_to=name)
            result = runner.invoke(app, ["join", "--server", "127.0.0.1:1", "--insecure", "--report-to", name,
                                         "--workdir", str(tmp_path), "--key", str(tmp_path / "key.pem")])
            assert result.exit_code == 2 and f"pip install {name}" in result.output
            assert not (tmp_path / "key.pem").exists()


def test_log_level_is_checked_before_any_work(tmp_path):
    result = runner.invoke(app, ["join", "--server", "127.0.0.1:1", "--insecure", "--log-level", "LOUD",
                                 "--workdir", str(tmp_path), "--key", str(tmp_path / "key.pem")])
    assert result.exit_code == 2
    assert result.output.strip().splitlines() == ["error: --log-level must be DEBUG, INFO, WARNING or ERROR, not 'LOUD'"]
    assert not (tmp_path / "key.pem").exists()
