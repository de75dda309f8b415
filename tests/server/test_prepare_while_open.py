"""A round waiting for submissions prepares its base's evaluation: the evaluator, the scoring gradient and the
held-out loss the lineage records, which the publish after the round closes would otherwise compute first. The
publish then finds them ready, with the same numbers."""

from __future__ import annotations

import json
import logging
import time

from zoo_gym import codec
from zoo_gym.proto import archive


def _messages(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "zoo_gym.server"]


def _wait_for(caplog, text: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not any(text in m for m in _messages(caplog)):
        assert time.monotonic() < deadline, f"no server log line with {text!r} within {timeout} s"
        time.sleep(0.1)


def test_the_base_is_evaluated_while_the_round_waits_and_its_publish_uses_that(federation, caplog) -> None:
    caplog.set_level(logging.INFO, logger="zoo_gym.server")
    fed = federation
    genesis = fed.round().base_sha256
    _wait_for(caplog, "round 1 base")  # before any submission
    evaluator = fed.rounds.evaluators.for_base(genesis)  # the manager's, as the publish will get it
    assert evaluator.has_gradient and evaluator.has_heldout
    prepared_loss = evaluator.heldout_loss()

    for i in range(2):
        key, cid = fed.register()
        fed.submit(key, cid, codec.encode(fed.small_delta(seed=i)))
    published = fed.wait_published(1).published_sha256
    model_dir, _ = fed.state.checkpoint_files(published)
    lineage = json.loads((model_dir / archive.LINEAGE).read_text())
    assert lineage["history"][0]["heldout_loss"] == prepared_loss  # the genesis's, as measured while open

    messages = _messages(caplog)
    prepared = next(i for i, m in enumerate(messages) if m.startswith("round 1 base") and "prepared while open" in m)
    closed = next(i for i, m in enumerate(messages) if m.startswith("round 1 closed with"))
    assert prepared < closed
    assert "scoring gradient, held-out loss" in messages[prepared]  # the genesis has no recorded loss yet
    # round 2's base was measured by round 1's publish: nothing left to prepare while round 2 waits
    time.sleep(1.5)  # the manager checks an open round every second
    assert not any(m.startswith("round 2 base") for m in _messages(caplog))
