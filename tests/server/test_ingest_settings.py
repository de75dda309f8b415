"""An ingest process's settings (issue 50 item 4): its own are the transport's; the round settings are serve's,
read from the serve.json serve writes at start and read again when serve writes it anew. A round setting given
to the ingest process that differs from serve's is refused naming it; the same config file as serve's passes."""

from __future__ import annotations

import grpc
import pytest

from zoo_gym.server.config import INGEST_SETTINGS, ConfigError, build_config, ingest_config, ingest_leaves
from zoo_gym.server.errors import Unavailable
from zoo_gym.server.store.state import record_serve_settings, serve_settings
from zoo_gym.server.transport.ingest import ServeSettings
from zoo_gym.settings import flat_values


def _serve(root, **flags) -> None:
    """What `gym-server serve` records at start."""
    record_serve_settings(root, flat_values(build_config({}, **flags)))


def test_the_round_settings_are_serves_and_the_transport_ones_its_own(tmp_path):
    _serve(tmp_path, port=50051, insecure=True, mode="async", buffer_size=5, aggregator="median",
           mirrors=["https://m.example/z"], max_payload_bytes=1 << 20, register_rate_per_peer=3.0)
    recorded, _ = serve_settings(tmp_path)
    cfg = ingest_config(recorded, {"port": 50052, "insecure": True}, environ={}, max_uploads=4)
    assert (cfg.port, cfg.insecure, cfg.max_uploads, cfg.register_rate_per_peer) == (50052, True, 4, 10.0)
    assert (cfg.mode, cfg.buffer_size, cfg.soup.aggregator, cfg.mirrors, cfg.max_payload_bytes) == (
        "async", 5, "median", ["https://m.example/z"], 1 << 20)
    assert {leaf.key for leaf in ingest_leaves()} == set(INGEST_SETTINGS)  # its flags: only its own settings


def test_a_round_setting_other_than_serves_is_refused_by_name(tmp_path):
    _serve(tmp_path, insecure=True, min_contributors=4, aggregator="median")
    recorded, _ = serve_settings(tmp_path)
    same_file = {"min_contributors": 4, "aggregator": "median", "port": 7}  # serve's own --config passes
    assert ingest_config(recorded, same_file, environ={}).port == 7
    with pytest.raises(ConfigError, match="`min_contributors` is 2 here but 4 in the running gym-server serve"):
        ingest_config(recorded, {"min_contributors": 2}, environ={})
    with pytest.raises(ConfigError, match="`aggregator` is 'mean' here"):
        ingest_config(recorded, {}, environ={"ZOO_GYM_AGGREGATOR": "mean"})


def test_settings_follow_serve_and_refuse_calls_while_they_cannot(tmp_path):
    _serve(tmp_path, insecure=True, min_contributors=4)
    followed = ServeSettings(tmp_path, lambda recorded: ingest_config(recorded, {"min_contributors": 4}, environ={}))
    assert followed.config.min_contributors == 4
    _serve(tmp_path, insecure=True, min_contributors=4, mode="async")  # serve restarted in async mode
    config, policy = followed.get()
    assert (config.mode, policy.name) == ("async", "async")
    _serve(tmp_path, insecure=True, min_contributors=5)  # now it conflicts with what this process was given
    with pytest.raises(Unavailable, match="min_contributors") as refused:
        followed.get()
    assert refused.value.code == grpc.StatusCode.UNAVAILABLE
    _serve(tmp_path, insecure=True, min_contributors=4)
    assert followed.get()[1].name == "sync"


def test_no_serve_yet_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="no gym-server serve has run on .* start it first"):
        ServeSettings(tmp_path, lambda recorded: ingest_config(recorded, environ={}))
