"""trust-mean on the server (issue 46): robust under DP with the mean's bound. Each delta weighs
max(0, cos(delta, -g)), g the gradient of the operator's validation loss at the base, over the fixed m."""

from __future__ import annotations

import json

import pytest

from zoo_gym import codec
from zoo_gym.aggregation.privacy import epsilon
from zoo_gym.server.config import ConfigError, build_config
from zoo_gym.server.store.models import Round


def test_a_dp_round_gives_no_weight_to_the_delta_against_the_operators_direction(federation_with):
    fed = federation_with(aggregator="trust-mean", min_contributors=3, dp_noise_multiplier=1.0, dp_clip=0.05,
                          dp_expected_contributors=3, dp_target_epsilon=1000.0)
    d = fed.small_delta(seed=0)
    ids = []
    for scale in (1.0, 2.0, -3.0):  # two deltas one way, a boosted reversal the other way
        key, cid = fed.register()
        ids.append(cid)
        fed.submit(key, cid, codec.encode({k: scale * v for k, v in d.items()}, codec="fp16"))
    fed.wait_published(1)
    with fed.state.session() as s:
        r = s.get(Round, 1)
        report = json.loads(r.report_json)
        eps = r.dp_epsilon_total
    rows = {c["contributor"]: c for c in report["soup"]["contributors"]}
    weights = [rows[cid]["weight"] for cid in ids]
    # whichever way agrees with the validation loss's descent direction counts, the other counts for nothing;
    # the two clipped deltas of one direction weigh the same; none above 1 / m (the bound the noise covers)
    assert (weights[2] == 0.0) != (weights[0] == 0.0) and weights[0] == pytest.approx(weights[1])
    assert all(0.0 <= w <= 1.0 / 3 + 1e-12 for w in weights)
    assert report["soup"]["privacy"]["mechanism"] == "trust-mean / fixed m=3"
    assert eps == pytest.approx(epsilon([(0.5, 1.0, 1)], delta=1e-5))


def test_trust_mean_without_a_validation_set_is_refused_at_start():
    with pytest.raises(ConfigError, match="needs `validation_examples` > 0"):
        build_config({}, insecure=True, aggregator="trust-mean", validation_examples=0)
