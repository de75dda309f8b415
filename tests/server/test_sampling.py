"""Server-side Poisson sampling (issue 31): who is selected is fixed by the server's key and the round, the same
for every asker and after a restart; an unselected delta is refused before anything is stored."""

from __future__ import annotations

import time
from datetime import datetime, timezone

import grpc
import pytest

from zoo_gym import codec
from zoo_gym.client.upload import get_round_request
from zoo_gym.proto import signing
from zoo_gym.server.rounds import sampling
from zoo_gym.server.store.models import Round

Q = 0.5


def _open_after_registering(fed, n: int) -> list[tuple]:
    """`n` contributors, then round 1 treated as opened after them (so all are eligible for its first draw)."""
    people = [fed.register() for _ in range(n)]
    with fed.state.session() as s:
        r = s.get(Round, 1)
        r.opened_at = datetime.now(timezone.utc)
        s.add(r)
        s.commit()
    return people


def test_selection_is_the_servers_and_the_rounds_whoever_asks_and_after_a_restart(federation_with, tmp_path):
    fed = federation_with(sample_rate=Q, min_contributors=2)
    people = _open_after_registering(fed, 12)
    with fed.state.session() as s:
        rnd = s.get(Round, 1)
        chosen = sampling.selected_ids(s, sampling.selection_key(fed.state.key), rnd, Q)
        reloaded, _ = signing.load_or_create_key(fed.state.root / "server_key.pem")  # what a restart loads
        assert sampling.selected_ids(s, sampling.selection_key(reloaded), rnd, Q) == chosen
    assert 0 < len(chosen) < 12  # 12 fair coins: P(all or none) = 2 / 4096
    answers = [fed.stub.GetRound(get_round_request(key, cid)) for key, cid in people]
    assert {a.selected_count for a in answers} == {len(chosen)}  # the same count for every asker
    assert [a.selected for a in answers] == [cid in chosen for _, cid in people]
    unsigned = fed.round()
    assert unsigned.sample_rate == Q and unsigned.selected_count == len(chosen) and not unsigned.selected
    # another round, another draw; the coins are the key's: another server selects other people
    assert [sampling.coin(b"k" * 32, 1, 0, c) for _, c in people] != [sampling.coin(b"k" * 32, 2, 0, c)
                                                                       for _, c in people]


def test_an_unselected_submission_is_refused_and_nothing_is_stored(federation_with):
    fed = federation_with(sample_rate=Q, min_contributors=2)
    people = _open_after_registering(fed, 12)
    with fed.state.session() as s:
        chosen = set(sampling.selected_ids(s, sampling.selection_key(fed.state.key), s.get(Round, 1), Q))
    key, cid = next(p for p in people if p[1] not in chosen)
    blobs = fed.blob_count()
    with pytest.raises(grpc.RpcError) as err:
        fed.submit(key, cid, codec.encode(fed.small_delta(seed=1), codec="fp16"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "not selected for round 1" in err.value.details() and "round 2 opens" in err.value.details()
    assert fed.stored_submissions() == 0 and fed.blob_count() == blobs
    key, cid = next(p for p in people if p[1] in chosen)
    assert fed.submit(key, cid, codec.encode(fed.small_delta(seed=2), codec="fp16")).round_id == 1
    assert fed.stored_submissions() == 1


def test_a_round_short_of_selected_people_adds_a_draw_and_the_accountant_charges_the_union():
    rnd = Round(id=7, base_sha256="0" * 64, opened_at=datetime(2026, 1, 1, tzinfo=timezone.utc))
    key = b"\x01" * 32
    early = datetime(2025, 1, 1, tzinfo=timezone.utc)
    ids = [f"{i:032x}" for i in range(40)]
    first = {c for c in ids if sampling.is_selected(key, rnd, c, early, 0.1)}

    class Session:  # widen only adds the row
        def add(self, row):
            pass

    assert sampling.widen(Session(), rnd, time.time()) == 2
    second = {c for c in ids if sampling.is_selected(key, rnd, c, early, 0.1)}
    assert first <= second  # a draw only adds people; deterministic from the stored cutoffs
    assert sampling.effective_rate(0.1, 2) == pytest.approx(0.19)
    late = datetime.now(timezone.utc).replace(year=2100)  # registered after every cutoff: never selected
    assert not any(sampling.is_selected(key, rnd, c, late, 0.1) for c in ids)
    assert all(sampling.is_selected(key, rnd, c, late, 1.0) for c in ids)  # q = 1: everyone, as before


def test_a_round_is_charged_the_sample_rate_it_closed_with_whatever_the_setting_says_later(federation_with):
    import dataclasses

    from sqlmodel import select

    from zoo_gym.aggregation.privacy import epsilon
    from zoo_gym.server.rounds.policy import policy_for
    from zoo_gym.server.rounds.publish import publish_round, record_round_inputs
    from zoo_gym.server.store.models import RoundInputs, RoundState, Submission

    z, delta = 1.0, 1e-5
    fed = federation_with(sample_rate=Q, min_contributors=3, aggregator="mean", dp_noise_multiplier=z, dp_clip=0.05,
                          dp_expected_contributors=2, dp_delta=delta)
    fed.rounds.stop()  # this test closes and publishes the round itself
    people = _open_after_registering(fed, 12)
    with fed.state.session() as s:
        chosen = set(sampling.selected_ids(s, sampling.selection_key(fed.state.key), s.get(Round, 1), Q))
    for seed, (key, cid) in enumerate([p for p in people if p[1] in chosen][:2]):
        fed.submit(key, cid, codec.encode(fed.small_delta(seed=seed), codec="fp16"))
    with fed.state.write_lock, fed.state.session() as s:  # close it, as the manager does
        rnd = s.get(Round, 1)
        rnd.state, rnd.closed_at = RoundState.AGGREGATING, datetime.now(timezone.utc)
        s.add(rnd)
        subs = list(s.exec(select(Submission).where(Submission.round_id == 1).order_by(Submission.id)))
        record_round_inputs(fed.state, fed.config, policy_for(fed.config), 1, [x.contributor_id for x in subs], s)
        s.commit()
        s.refresh(rnd)

    later = dataclasses.replace(fed.config, sample_rate=0.9)  # a restart with another --sample-rate
    assert publish_round(fed.state, later, rnd, subs).startswith("published")

    with fed.state.session() as s:
        assert s.get(RoundInputs, 1).sample_rate == Q  # what selection used, recorded at close
        published = s.get(Round, 1)
        # the ledger names whom the round paid: participation is public, so the sampling hides nobody and
        # amplifies nothing; the release is charged replace-one (z / 2) at q = 1, whatever --sample-rate says
        assert published.dp_sample_rate == 1.0
        assert published.dp_epsilon_total == pytest.approx(epsilon([(z / 2, 1.0, 1)], delta=delta))
        assert published.dp_epsilon_total > epsilon([(z, Q, 1)], delta=delta)
