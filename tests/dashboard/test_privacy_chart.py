"""Under DP the privacy chart shows the epsilon a real round spent against --dp-target-epsilon."""

from __future__ import annotations

import time

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from zoo_gym import codec
from zoo_gym.dashboard import create_app
from zoo_gym.server.store.models import Round


def test_epsilon_spent_is_charted_against_the_target(federation_with):
    fed = federation_with(min_contributors=3, aggregator="mean", dp_noise_multiplier=1.0, dp_clip=1.0,
                          dp_expected_contributors=3, dp_target_epsilon=1000.0)
    for i in range(3):
        key, cid = fed.register()
        fed.submit(key, cid, codec.encode(fed.small_delta(seed=i), codec="fp16"))
    deadline = time.monotonic() + 120
    while fed.round().round_id < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    with fed.state.session() as s:
        spent = s.get(Round, 1).dp_epsilon_total
    assert spent is not None and spent > 0, "round 1 was not published under DP within 120 s"
    web = TestClient(create_app(fed.state, registry=fed.rounds.metrics.registry, dp_target_epsilon=1000.0))
    privacy = web.get("/api/privacy").json()
    assert privacy["target"] == 1000.0 and privacy["rounds"][0]["round"] == 1
    assert privacy["rounds"][0]["epsilon_total"] == pytest.approx(spent)
    page = web.get("/").text
    chart = page[page.index('id="privacy-chart"'):]
    chart = chart[:chart.index("</svg>")]
    assert 'data-round="1"' in chart and f'data-value="{spent:.6g}"' in chart and "target 1000" in chart
    metrics = {s.name: s.value for f in text_string_to_metric_families(web.get("/metrics").text) for s in f.samples}
    assert metrics["zoo_gym_dp_epsilon_spent"] == pytest.approx(spent)
