"""Rounds: close at quorum, publish a loadable checkpoint with lineage, settle the ledger, survive restarts."""

from __future__ import annotations

import json
import time

from sqlmodel import select

from zoo_gym import codec
from zoo_gym.proto import archive
from zoo_gym.server.models import Checkpoint, Round, RoundState
from zoo_gym.server.rounds import RoundManager
from zoo_gym.server.state import open_state


def _wait_published(fed, round_id: int, timeout: float = 120.0) -> Round:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with fed.state.session() as s:
            r = s.get(Round, round_id)
            if r.state == RoundState.PUBLISHED:
                return r
        time.sleep(0.2)
    raise AssertionError(f"round {round_id} was not published within {timeout} s")


def test_round_publishes_at_quorum_with_lineage_and_ledger(federation, tmp_path):
    from transformers import AutoModelForCausalLM

    submitted = []
    for seed in range(2):  # min_contributors = 2
        key, cid = federation.register()
        federation.submit(key, cid, codec.encode(federation.small_delta(seed=seed), codec="bitdelta"))
        submitted.append(cid)
    rnd = _wait_published(federation, 1)
    info = federation.round()
    assert info.round_id == 2 and info.base_sha256 == rnd.published_sha256
    with federation.state.session() as s:
        ckpt = s.get(Checkpoint, rnd.published_sha256)
    lineage = json.loads(ckpt.manifest_json)
    assert lineage["round"] == 1 and lineage["parent_sha256"] == rnd.base_sha256
    assert sorted(lineage["contributors"]) == sorted(submitted)
    model_dir = archive.unpack(federation.state.blobs.path(ckpt.sha256), tmp_path / "published")
    assert AutoModelForCausalLM.from_pretrained(model_dir).num_parameters() > 0
    assert ckpt.heldout_loss is not None
    from zoo_gym.server.settlement import ledger_entries, verify_ledger

    entries = ledger_entries(federation.state, contributor=None, since_seq=0, limit=None)
    assert sorted(e["contributor_id"] for e in entries) == sorted(submitted)
    assert verify_ledger(federation.state)["ok"]


def test_interrupted_aggregation_resumes_after_restart(federation):
    for seed in range(2):
        key, cid = federation.register()
        federation.submit(key, cid, codec.encode(federation.small_delta(seed=seed), codec="fp16"))
    _wait_published(federation, 1)
    # Simulate a crash in the middle of round 2's aggregation: state AGGREGATING, nothing published.
    federation.rounds.stop()
    for seed in range(2, 4):
        key, cid = federation.register()
        federation.submit(key, cid, codec.encode(federation.small_delta(seed=seed), codec="fp16"))
    with federation.state.write_lock, federation.state.session() as s:
        r = s.get(Round, 2)
        r.state = RoundState.AGGREGATING
        s.add(r)
        s.commit()
    reopened = open_state(federation.state.root)
    manager = RoundManager(reopened, federation.config)
    manager.step()  # what the restarted server's manager does first
    with reopened.session() as s:
        r2 = s.get(Round, 2)
        assert r2.state == RoundState.PUBLISHED and s.get(Round, 3).state == RoundState.OPEN
        assert len(list(s.exec(select(Checkpoint)))) == 3
    reopened.engine.dispose()
