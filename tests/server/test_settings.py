"""Every server setting is declared once and can be set three ways: flag, environment variable ZOO_GYM_<KEY>, file.

Precedence is flag > environment > file > default; what the server signs (RoundInfo) is read from the same typed
settings it runs with.
"""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from zoo_gym.server.cli import app
from zoo_gym.server.config import ServerConfig
from zoo_gym.settings import leaves

# A valid value other than the default for each setting that a generic rule cannot pick, with the settings it
# needs beside it (they are set the same way).
SPECIAL = {
    "host": ("0.0.0.0", {}),
    "quorum": (4, {}),
    "ssl_certfile": ("cert.pem", {}),
    "ssl_keyfile": ("key.pem", {}),
    "ssl_ca_certfile": ("ca.pem", {}),
    "admission": ("invite", {}),
    "mode": ("async", {}),
    "sample_rate": (0.5, {}),
    "validation_data": ("held-out.jsonl", {}),
    "evaluation_dtype": ("bfloat16", {}),
    "log_level": ("DEBUG", {}),
    "log_format": ("json", {}),
    "dashboard_host": ("0.0.0.0", {}),
    "dashboard_token_file": ("dashboard.token", {}),  # read only when the dashboard runs (dashboard_port > 0)
    "aggregator": ("median", {}),
    "multi_krum_m": (2, {}),
    "trim_beta": (0.25, {}),
    "trust_ramp": (0.25, {}),
    "dp_noise_multiplier": (0.5, {"dp_clip": 1.0, "aggregator": "mean", "dp_expected_contributors": 3}),
    "dp_adaptive_clip": (True, {"dp_clip": 1.0}),
    "dp_target_quantile": (0.25, {}),
    "dp_target_epsilon": (8.0, {"dp_noise_multiplier": 1.0, "dp_clip": 1.0, "aggregator": "mean",
                                "dp_expected_contributors": 3}),
    "dp_participation": ("private", {}),
    "max_weight_share": (0.5, {}),
    "scoring_method": ("exact", {}),
    "scoring_marginal": ("leave_one_out", {}),
    "scoring_metric": ("exact-match", {"scoring_method": "exact"}),
    "scoring_subsets": ("rule", {"scoring_method": "exact"}),
    "scoring_min_marginal_z": (2.0, {}),
    "reputation_initial": (0.2, {}),
    "reputation_floor": (0.1, {}),
    "reputation_cap": (0.9, {}),
    "reputation_alpha": (0.3, {}),
    "reputation_penalty_alpha": (0.25, {}),
    "dp_delta": (1e-6, {}),
    "mirrors": (["http://mirror-a.example/zoo", "https://mirror-b.example"], {}),  # repeated: --mirrors A --mirrors B
    "aggregation_engine": ("ray", {}),  # found, not imported or joined: the cluster is joined at the first round
    "ray_address": ("10.0.0.5:6379", {"aggregation_engine": "ray"}),
}
LEAVES = leaves(ServerConfig)


def _value(leaf):
    if leaf.key in SPECIAL:
        return SPECIAL[leaf.key]
    if leaf.kind is bool:
        return (not leaf.default, {})
    if leaf.kind is int:
        return ((leaf.default or 0) + 1, {})
    if leaf.kind is float:
        return ((leaf.default or 1.0) * 2, {})
    raise AssertionError(f"add a value for {leaf.key} to SPECIAL")


def _flag_args(key, value):
    leaf = next(x for x in LEAVES if x.key == key)
    if leaf.kind is bool:
        return [leaf.flag if value else "--no-" + leaf.flag[2:]]
    if leaf.repeatable:
        return [a for v in value for a in (leaf.flag, v)]
    return [leaf.flag, str(value)]


def _env_text(value):
    if isinstance(value, list):
        return ",".join(value)
    return str(value).lower() if isinstance(value, bool) else str(value)


def _settings(args, env=None, tmp_path=None, file_values=None):
    if file_values is not None:
        path = tmp_path / "server.toml"
        lines = []
        for key, value in file_values.items():
            text = json.dumps(value) if not isinstance(value, bool) else str(value).lower()
            lines.append(f"{key.replace('_', '-')} = {text}")
        path.write_text("\n".join(lines) + "\n")
        args = [*args, "--config", str(path)]
    res = CliRunner().invoke(app, ["settings", *args], env=env or {})
    assert res.exit_code == 0, res.output
    return json.loads(res.output)


def test_every_setting_has_help_a_flag_an_env_var_and_one_default():
    keys = [leaf.key for leaf in LEAVES]
    assert len(keys) == len(set(keys)) > 60
    assert all(leaf.help for leaf in LEAVES), [leaf.key for leaf in LEAVES if not leaf.help]
    res = CliRunner().invoke(app, ["serve", "--help"], env={"COLUMNS": "2000"})
    assert res.exit_code == 0
    for leaf in LEAVES:
        assert leaf.flag in res.output and leaf.env in res.output, leaf.key


@pytest.mark.parametrize("leaf", LEAVES, ids=[leaf.key for leaf in LEAVES])
def test_each_setting_is_set_by_flag_env_and_file(leaf, tmp_path):
    value, companions = _value(leaf)
    assert value != leaf.default
    expected = {**companions, leaf.key: value}
    # the flag
    args = [a for k, v in expected.items() for a in _flag_args(k, v)]
    got = _settings(args)
    assert {k: got[k] for k in expected} == expected
    # the environment
    got = _settings([], env={f"ZOO_GYM_{k.upper()}": _env_text(v) for k, v in expected.items()})
    assert {k: got[k] for k in expected} == expected
    # the file
    got = _settings([], tmp_path=tmp_path, file_values=expected)
    assert {k: got[k] for k in expected} == expected


def test_precedence_is_flag_then_env_then_file_then_default(tmp_path):
    env = {"ZOO_GYM_MIN_CONTRIBUTORS": "5", "ZOO_GYM_TRIM_BETA": "0.2"}
    file_values = {"min_contributors": 7, "trim_beta": 0.3, "reward_pool": 9}
    got = _settings(["--min-contributors", "4"], env=env, tmp_path=tmp_path, file_values=file_values)
    assert (got["min_contributors"], got["trim_beta"], got["reward_pool"], got["buffer_size"]) == (4, 0.2, 9, 3)


def test_bad_env_value_is_one_line_naming_the_variable():
    res = CliRunner().invoke(app, ["settings"], env={"ZOO_GYM_MIN_CONTRIBUTORS": "three"})
    assert res.exit_code == 2
    assert "ZOO_GYM_MIN_CONTRIBUTORS='three'" in res.output and "integer" in res.output
    assert "Traceback" not in res.output


def test_signed_round_info_names_the_rule_and_privacy_the_server_runs_with(federation_with, sign):
    # no --aggregator, no DP flags: the defaults of the settings the server aggregates with
    fed = federation_with(aggregator=None, min_contributors=3, validation_examples=0)
    info = fed.round()
    assert fed.config.soup.aggregator == "trimmed-mean"
    assert info.aggregator == "trimmed-mean"
    assert info.dp_delta == pytest.approx(fed.config.soup.dp_delta)
    sign.verify(bytes(info.server_public_key), bytes(info.signature), sign.round_info_bytes(info))
