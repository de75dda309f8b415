"""A round whose accepted contributions are all one delta is warned about once (the server's log and the round's
report), with the aggregate untouched; distinct contributions draw no such note."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from zoo_gym import codec
from zoo_gym.server.rounds import identical
from zoo_gym.server.rounds.identical import copy_groups, identical_warning, round_notes


def _publish(fed, seeds: list[int]):
    for seed in seeds:
        key, cid = fed.register()
        fed.submit(key, cid, codec.encode(fed.small_delta(seed=seed), codec="fp16"))
    return fed.wait_published(1)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and "copies of one" in
            r.getMessage()]


@pytest.mark.slow
def test_a_round_of_identical_contributions_is_warned_about_once_and_recorded(federation_with, caplog):
    caplog.set_level(logging.WARNING, logger="zoo_gym.server")
    fed = federation_with(min_contributors=3, aggregator="mean")
    rnd = _publish(fed, [7, 7, 7])
    report = json.loads(rnd.report_json)
    assert report["warnings"] == [identical_warning([0, 0, 0])]
    assert report["warnings"][0].startswith("all 3 accepted contributions are copies of one delta (1 distinct)")
    assert _warnings(caplog) == [f"round 1: {report['warnings'][0]}"]  # one WARNING line for the round
    assert report["soup"]["n_accepted"] == 3  # nothing refused: the note is all that changes


@pytest.mark.slow
def test_distinct_contributions_draw_no_note(federation_with, caplog):
    caplog.set_level(logging.WARNING, logger="zoo_gym.server")
    fed = federation_with(min_contributors=3, aggregator="mean")
    report = json.loads(_publish(fed, [1, 2, 3]).report_json)
    assert "warnings" not in report and _warnings(caplog) == []


class _Rows:
    """A DeltaSource of in-memory rows (one tensor)."""

    def __init__(self, rows: torch.Tensor) -> None:
        self._rows = rows

    def names(self):
        return ["w"]

    def shape(self, name):
        return (self._rows.shape[1],)

    def stacked(self, name):
        return self._rows


def test_most_but_not_all_copies_are_named_and_a_minority_is_not():
    a, b, c = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    rows = _Rows(torch.stack([a, a, a, b, c]))
    assert copy_groups(rows, ["x"] * 5, [0, 1, 2, 3, 4]) == [0, 0, 0, 3, 4]
    assert identical_warning([0, 0, 0, 3, 4]).startswith("3 of 5 accepted contributions are copies of one delta "
                                                         "(3 distinct)")
    assert identical_warning([0, 0, 2, 3]) is None  # half are copies: not most
    assert identical_warning([0]) is None
    assert copy_groups(rows, ["x"] * 5, [2, 3]) == [0, 1]  # only the accepted rows count


def test_large_rounds_match_byte_identical_payloads(monkeypatch):
    monkeypatch.setattr(identical, "DENSE_CHECK_BYTES", 0)
    rows = _Rows(torch.randn(3, 8))  # not read: the payload hashes decide
    rows.stacked = lambda name: pytest.fail("decoded a large round's rows")
    assert copy_groups(rows, ["s1", "s1", "s2"], [0, 1, 2]) == [0, 0, 2]
    assert round_notes(rows, ["s1", "s1", "s1"], [0, 1, 2], private=False)[0].startswith("all 3 accepted")


def test_no_note_under_dp():
    rows = _Rows(torch.zeros(3, 8))
    assert round_notes(rows, ["s"] * 3, [0, 1, 2], private=True) == []
