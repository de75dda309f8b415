"""gym-demo's per-round table: every row's columns line up with the header's (issue 30: the `change` column
was misaligned, and so was held-out loss)."""

from __future__ import annotations

import math

import pytest

from zoo_gym import demo


def _status(parent: float | None, loss: float, contributors: int = 3) -> dict:
    soup = {"contributors": [{"accepted": i != 0} for i in range(contributors)]}
    return {"checkpoints": [{"round": 0, "heldout_loss": parent, "sha256": "a" * 64},
                            {"round": 1, "heldout_loss": loss, "sha256": "0123456789abcdef" * 4}],
            "rounds": [{"id": 1, "report": {"soup": soup}}]}


def _pipes(line: str) -> list[int]:
    return [i for i, ch in enumerate(line) if ch == "|"]


@pytest.mark.parametrize("parent,loss", [(2.5, 2.25), (2.5, 2.75), (0.001, 123.456), (12345.6789, 0.0001),
                                         (None, 2.0), (0.0, 1.0)])
def test_rows_line_up_with_the_header(parent, loss):
    header, rule = demo.table_header()
    row = demo.round_row(_status(parent, loss), 1)
    assert _pipes(header) == _pipes(rule) == _pipes(row), "\n".join((header, rule, row))
    assert len(header) == len(rule) == len(row)
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[0] == "1" and cells[1] == "3" and cells[2] == "2" and cells[6] == "0123456789ab"
    if parent:
        change = (loss - parent) / parent * 100
        assert cells[5] == f"{change:+.1f}%" if abs(change) < 1e5 else cells[5] == f"{change:+.2g}%".replace("e+0", "e")
        assert math.isclose(float(cells[4]), loss, rel_tol=1e-3, abs_tol=1e-4)
    else:
        assert cells[5] in ("-", "nan%")
