"""The inline SVG charts carry their points and tell close ticks apart."""

from __future__ import annotations

import re

from zoo_gym.dashboard.charts import line_chart


def test_points_limit_and_distinct_ticks():
    svg = str(line_chart([(0, 5.8223), (1, 5.8224), (2, 5.8101)], chart_id="c", title="loss", y_label="loss",
                         limit=5.83, limit_label="target"))
    assert re.findall(r'data-round="(\d+)" data-value="([^"]+)"', svg) == [("0", "5.8223"), ("1", "5.8224"),
                                                                         ("2", "5.8101")]
    ticks = re.findall(r'class="tick"[^>]*text-anchor="end">([^<]+)<', svg)
    assert len(ticks) == 5 and len(set(ticks)) == 5
    assert 'class="limit"' in svg and "target" in svg


def test_nothing_to_draw_says_so():
    assert "nothing measured yet" in str(line_chart([], chart_id="c", title="Privacy", y_label="eps"))


def test_a_single_point_and_escaping():
    svg = str(line_chart([(3, 1.0)], chart_id="c", title="<b>", y_label="x"))
    assert 'data-round="3"' in svg and "<b>" not in svg
