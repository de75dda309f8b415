"""The server's per-contributor log lines summarised (issue 51): the first `each` of a kind at INFO, the rest at
DEBUG, and one INFO line per `every` seconds counting what was held back; nothing said twice or lost."""

import logging

from zoo_gym.server.metrics import LogSummary


def test_lines_past_the_first_of_a_kind_go_to_debug_and_are_counted(caplog):
    now = [0.0]
    summary = LogSummary(each=3, every=10.0, clock=lambda: now[0])
    caplog.set_level(logging.INFO, logger="zoo_gym.server")
    levels = [summary.level("submission", "submissions accepted") for _ in range(5)]
    levels.append(summary.level("submission", "submissions refused INVALID_ARGUMENT"))
    levels += [summary.level("registration", "registrations") for _ in range(4)]
    assert levels == [logging.INFO] * 3 + [logging.DEBUG] * 3 + [logging.INFO] * 3 + [logging.DEBUG]
    assert not caplog.records  # less than 10 s since the start: held back
    now[0] = 10.5
    summary.flush()
    summary.flush()  # nothing new: no second line
    [line] = [r.getMessage() for r in caplog.records]
    assert "2 submissions accepted" in line and "1 submissions refused INVALID_ARGUMENT" in line
    assert "1 registrations" in line and caplog.records[0].counts == {
        "submissions accepted": 2, "submissions refused INVALID_ARGUMENT": 1, "registrations": 1}
    summary.level("submission", "submissions accepted")
    summary.flush(force=True)  # the round closes: said at once
    assert "1 submissions accepted" in caplog.records[-1].getMessage() and len(caplog.records) == 2
