"""The publish reads a tensor's next block of rows while the rule works on this one (streaming.read_ahead): the
parts come in order, each once, at most one ahead, and an error reading one reaches the caller."""

import threading
import time

import pytest
import torch

from zoo_gym.aggregation.streaming import read_ahead


def _part(i: int, calls: list[int], fail_at: int | None = None):
    def read() -> torch.Tensor:
        if i == fail_at:
            raise ValueError(f"part {i} is unreadable")
        calls.append(i)
        return torch.full((3,), float(i))

    return read


def _eventually(predicate, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not predicate():
        time.sleep(0.01)
    return predicate()


def test_the_next_part_is_read_in_another_thread_while_the_caller_holds_this_one():
    calls: list[int] = []
    threads: set[int] = set()

    def part(i):
        read = _part(i, calls)
        return lambda: (threads.add(threading.get_ident()), read())[1]

    seen = []
    for key, rows in read_ahead((i, part(i)) for i in range(5)):
        if key < 4:
            assert _eventually(lambda: key + 1 in calls), f"part {key + 1} was not read while the caller held {key}"
        assert max(calls) <= key + 1  # never two ahead: two sets of buffers suffice
        seen.append((key, rows.tolist()))
    assert seen == [(i, [float(i)] * 3) for i in range(5)]
    assert calls == list(range(5)) and threading.get_ident() not in threads


def test_an_error_reading_a_part_reaches_the_caller_and_nothing_after_it_is_read():
    calls: list[int] = []
    got = []
    with pytest.raises(ValueError, match="part 2 is unreadable"):
        for key, _ in read_ahead((i, _part(i, calls, fail_at=2)) for i in range(5)):
            got.append(key)
    assert got == [0, 1] and calls == [0, 1]


def test_no_parts_and_one_part():
    assert list(read_ahead([])) == []
    (key, rows), = read_ahead([("only", lambda: torch.ones(2))])
    assert key == "only" and rows.tolist() == [1.0, 1.0]
