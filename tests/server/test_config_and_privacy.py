"""Server settings from flags and files, and the privacy budget stopping publication before it overspends."""

from __future__ import annotations

import time

import pytest
from typer.testing import CliRunner

from zoo_gym import codec
from zoo_gym.aggregation import SoupConfig
from zoo_gym.proto import gym_pb2
from zoo_gym.server.cli import app
from zoo_gym.server.config import ConfigError, ServerConfig, build_config, read_config_file
from zoo_gym.server.store.models import Round, RoundState
from zoo_gym.server.transport.servicer import build_server


def test_file_values_are_overridden_by_flags_and_routed(tmp_path):
    path = tmp_path / "server.toml"
    path.write_text('min-contributors = 5\naggregator = "mean"\n[privacy]\ndp-clip = 0.5\n'
                    'dp-noise-multiplier = 1.0\ndp-expected-contributors = 5\n[rewards]\nreward-pool = 77\n')
    cfg = build_config(read_config_file(path), min_contributors=4, byzantine_f=1)
    assert cfg.min_contributors == 4  # the flag wins
    soup = cfg.soup
    assert (soup.aggregator, soup.dp_clip, soup.dp_noise_multiplier, soup.byzantine_f) == ("mean", 0.5, 1.0, 1)
    assert soup.trim_beta == SoupConfig.trim_beta == 0.4  # not given anywhere: the one default
    assert cfg.rewards.reward_pool == 77
    yaml_path = tmp_path / "server.yaml"
    yaml_path.write_text("aggregator: trimmed-mean\ntrim-beta: 0.2\n")
    assert build_config(read_config_file(yaml_path)).soup.trim_beta == 0.2


@pytest.mark.parametrize("args, says", [
    (["--dp-noise-multiplier", "1", "--dp-clip", "0.5", "--dp-expected-contributors", "5"],
     "`aggregator` must be mean or trust-mean (the robust one), got 'trimmed-mean'"),
    (["--dp-noise-multiplier", "1", "--dp-clip", "0.5", "--aggregator", "krum", "--byzantine-f", "1",
      "--dp-expected-contributors", "5"], "`aggregator` must be mean or trust-mean (the robust one), got 'krum'"),
    (["--dp-noise-multiplier", "1", "--dp-clip", "0.5", "--aggregator", "mean"], "`dp_expected_contributors` (m)"),
    (["--dp-noise-multiplier", "1", "--dp-clip", "0.5", "--aggregator", "mean", "--dp-expected-contributors", "5",
      "--dp-participation", "hidden"], "`dp_participation` must be public or private"),
])
def test_serve_and_settings_refuse_dp_without_a_proven_bound_in_one_line(tmp_path, args, says):
    """Nothing starts, nothing is created, and one line names what is allowed."""
    for command in (["settings"], ["serve", "--state-dir", str(tmp_path / "fed"), "--insecure"]):
        res = CliRunner().invoke(app, command + args)
        assert res.exit_code != 0 and says in res.output and "Traceback" not in res.output, res.output
    assert not (tmp_path / "fed").exists()


def test_a_typo_is_an_error_naming_the_key(tmp_path):
    with pytest.raises(ConfigError, match="`reward_pol`; did you mean `reward_pool`"):
        build_config({"reward_pol": 5})
    with pytest.raises(ConfigError, match="min_contributors"):
        build_config({}, min_contributors=0)


def test_serve_refuses_bad_settings_with_one_line(tmp_path):
    res = CliRunner().invoke(app, ["serve", "--state-dir", str(tmp_path / "nope"), "--aggregator", "krumm"])
    assert res.exit_code == 2
    assert "aggregator" in res.output and "Traceback" not in res.output
    res = CliRunner().invoke(app, ["serve", "--state-dir", str(tmp_path / "nope")])
    assert res.exit_code == 2 and "gym-server init" in res.output


def test_privacy_budget_halts_publication_before_overspending(federation):
    # Reconfigure the running federation: DP with a budget smaller than one round costs.
    federation.rounds.stop()
    federation.server.stop(grace=None)
    cfg = build_config({}, port=0, insecure=True, min_contributors=2, aggregator="mean", dp_noise_multiplier=0.5, dp_clip=0.01,
                       dp_expected_contributors=2, dp_target_epsilon=0.5, reward_pool=10)
    server, port, rounds = build_server(federation.state, cfg)
    server.start()
    rounds.start()
    import grpc

    from zoo_gym.proto import gym_pb2_grpc

    federation.stub = gym_pb2_grpc.GymStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    checkpoints_before = federation.blob_count()
    for seed in range(2):
        key, cid = federation.register()
        federation.submit(key, cid, codec.encode(federation.small_delta(seed=seed), codec="fp16"))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        info = federation.round()
        if info.state == gym_pb2.ROUND_STATE_HALTED:
            break
        time.sleep(0.2)
    assert info.state == gym_pb2.ROUND_STATE_HALTED and "epsilon" in info.message
    with federation.state.session() as s:
        r = s.get(Round, 1)
        assert r.state == RoundState.HALTED and r.published_sha256 is None
    assert federation.blob_count() == checkpoints_before + 2  # the two submissions, no new checkpoint
    server.stop(grace=None)
    rounds.stop()


def test_dp_round_records_privacy_spent_in_round_and_manifest(federation):
    import json

    from zoo_gym.server.store.models import Checkpoint

    federation.rounds.stop()
    federation.server.stop(grace=None)
    cfg = build_config({}, port=0, insecure=True, min_contributors=2, aggregator="mean", dp_noise_multiplier=1.0, dp_clip=0.05,
                       dp_expected_contributors=2, dp_target_epsilon=1000.0)
    server, port, rounds = build_server(federation.state, cfg)
    server.start()
    rounds.start()
    import grpc

    from zoo_gym.proto import gym_pb2_grpc

    federation.stub = gym_pb2_grpc.GymStub(grpc.insecure_channel(f"127.0.0.1:{port}"))
    for seed in range(2):
        key, cid = federation.register()
        federation.submit(key, cid, codec.encode(federation.small_delta(seed=seed), codec="fp16"))
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and federation.round().round_id == 1:
        time.sleep(0.2)
    info = federation.round()
    assert info.round_id == 2 and info.dp_epsilon_spent > 0
    with federation.state.session() as s:
        r = s.get(Round, 1)
        lineage = json.loads(s.get(Checkpoint, r.published_sha256).manifest_json)
    assert r.dp_epsilon_total == pytest.approx(info.dp_epsilon_spent)
    assert lineage["privacy"]["epsilon_total"] == pytest.approx(r.dp_epsilon_total)
    assert lineage["privacy"]["noise_multiplier"] == 1.0 and lineage["privacy"]["clip"] == 0.05
    server.stop(grace=None)
    rounds.stop()
