"""The async client never trains twice on one version (issue 16): a second run on the base it had just trained
on gave the same delta (same weights, examples and seed), which went into the next buffer as a stale copy and
applied that step again. `_next_version` waits for the next version instead, and gives up after max_wait."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from zoo_gym.client import join_async
from zoo_gym.proto import gym_pb2


def _contributor(rounds: list[int]):
    """A Contributor whose server answers GetRound with these round ids, one per call (the last repeats)."""
    answers = iter(rounds)
    last = {"round": rounds[0]}

    def get_round(request, timeout):
        last["round"] = next(answers, last["round"])
        return gym_pb2.RoundInfo(round_id=last["round"], state=gym_pb2.ROUND_STATE_OPEN, mode="async",
                                 base_sha256=f"{last['round']:064x}", max_staleness=4)

    said: list[str] = []
    c = join_async.Contributor(stub=SimpleNamespace(GetRound=get_round), cid="c" * 32,
                               key=Ed25519PrivateKey.generate(), retry=lambda fn, what: fn(),
                               verified=lambda info: info, say=said.append, server_key=b"",
                               **{k: None for k in ("make_payload", "trainer")
                                  if k in join_async.Contributor.__dataclass_fields__})
    return c, said


@pytest.fixture
def no_sleep(monkeypatch):
    clock = {"t": 0.0}
    monkeypatch.setattr(join_async.time, "sleep", lambda s: clock.__setitem__("t", clock["t"] + s))
    monkeypatch.setattr(join_async.time, "monotonic", lambda: clock["t"])


def test_waits_for_the_version_after_the_one_it_trained_on(no_sleep):
    c, said = _contributor([2, 2, 2, 3])
    info = join_async._next_version(c, SimpleNamespace(max_wait=60), trained_round=2)
    assert info.round_id == 3  # not version 1 again
    assert said == ["already trained on version 1; waiting for the next version"]


def test_a_new_version_or_the_first_run_starts_at_once(no_sleep):
    c, said = _contributor([5])
    assert join_async._next_version(c, SimpleNamespace(max_wait=60), trained_round=None).round_id == 5
    assert join_async._next_version(c, SimpleNamespace(max_wait=60), trained_round=4).round_id == 5
    assert said == []


def test_no_new_version_within_max_wait_stops_with_the_reason(no_sleep):
    c, _ = _contributor([2])
    with pytest.raises(join_async.AsyncStop, match="no version after 1 was published within 30 s"):
        join_async._next_version(c, SimpleNamespace(max_wait=30), trained_round=2)
