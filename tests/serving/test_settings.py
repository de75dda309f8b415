"""Every gym-serve setting is declared once (ServeSettings) and can be set three ways: flag, environment
variable ZOO_GYM_<KEY>, --config file; precedence flag > environment > file > default."""

from __future__ import annotations

import json

import pytest
import typer
from typer.testing import CliRunner

from zoo_gym.serving import cli
from zoo_gym.serving.settings import ServeSettings
from zoo_gym.settings import leaves

LEAVES = leaves(ServeSettings)
SPECIAL = {"base": "tiny", "host": "0.0.0.0", "device": "cuda", "dtype": "bfloat16", "base_name": "mine",
           "max_variant_bytes": 1000, "api_key": "s3cret", "log_format": "json"}


@pytest.fixture
def run(monkeypatch, tmp_path):
    """gym-serve up to its settings: returns (exit code, output, ServeSettings or None)."""
    seen = {}
    resolve_settings = cli._settings

    def stop_after_settings(config, flags):
        seen["settings"] = resolve_settings(config, flags)
        raise typer.Exit(0)

    monkeypatch.setattr(cli, "_settings", stop_after_settings)

    def invoke(args, env=None, file_values=None):
        seen.clear()
        if file_values is not None:
            path = tmp_path / "serve.toml"
            path.write_text("".join(f"{k.replace('_', '-')} = {json.dumps(v)}\n" for k, v in file_values.items()))
            args = [*args, "--config", str(path)]
        res = CliRunner().invoke(cli.app, args, env=env or {})
        return res.exit_code, res.output, seen.get("settings")

    return invoke


def _value(leaf, tmp_path):
    if leaf.key == "variants":
        return str(tmp_path)
    if leaf.key in SPECIAL:
        return SPECIAL[leaf.key]
    return leaf.default + 1 if leaf.kind is int else leaf.default * 2


def test_every_setting_has_help_a_flag_and_an_env_var_in_help():
    res = CliRunner().invoke(cli.app, ["--help"], env={"COLUMNS": "2000"})
    assert res.exit_code == 0
    for leaf in LEAVES:
        assert leaf.help and leaf.flag in res.output and leaf.env in res.output, leaf.key
    for flag in ("--base", "--variants", "--host", "--port", "--max-variant-bytes", "--max-batch", "--batch-window-ms",
                 "--max-tokens", "--device", "--dtype", "--base-name", "--config"):  # the flags it always had
        assert flag in res.output


@pytest.mark.parametrize("leaf", LEAVES, ids=[leaf.key for leaf in LEAVES])
def test_each_setting_is_set_by_flag_env_and_file(leaf, run, tmp_path):
    value = _value(leaf, tmp_path)
    assert value != leaf.default
    base = [] if leaf.key == "base" else ["--base", "tiny"]
    for args, env, file_values in ([*base, leaf.flag, str(value)], None, None), \
                                  (base, {leaf.env: str(value)}, None), \
                                  (base, None, {leaf.key: value}):
        code, output, settings = run(args, env=env, file_values=file_values)
        assert code == 0 and settings is not None, output
        assert getattr(settings, leaf.key) == value


def test_precedence_is_flag_then_env_then_file_then_default(run):
    code, output, s = run(["--base", "tiny", "--max-batch", "4"], env={"ZOO_GYM_MAX_BATCH": "5", "ZOO_GYM_PORT": "9"},
                          file_values={"max_batch": 6, "port": 7, "max_tokens": 8})
    assert code == 0, output
    assert (s.max_batch, s.port, s.max_tokens, s.dtype) == (4, 9, 8, "float32")


@pytest.mark.parametrize("args, env, message", [
    ([], None, "no base model: give --base"),
    (["--base", "tiny", "--port", "70000"], None, "--port must be from 0 to 65535"),
    (["--base", "tiny", "--max-batch", "0"], None, "--max-batch must be >= 1"),
    (["--base", "tiny"], {"ZOO_GYM_DEVICE": "tpu"}, "--device must be cpu or cuda"),
    (["--base", "tiny"], {"ZOO_GYM_MAX_TOKENS": "many"}, "ZOO_GYM_MAX_TOKENS='many'"),
])
def test_bad_settings_exit_2_with_one_line(run, args, env, message):
    code, output, _ = run(args, env=env)
    assert code == 2 and message in output and "Traceback" not in output, output
    assert len(output.strip().splitlines()) == 1


def test_unknown_file_key_names_the_closest(run):
    code, output, _ = run(["--base", "tiny"], file_values={"max_bach": 3})
    assert code == 2 and "unknown setting `max_bach`; did you mean `max_batch`?" in output, output
