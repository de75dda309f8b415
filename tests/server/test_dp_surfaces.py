"""Every public surface after a DP round (issue 46): a stranger, or another contributor, finds no per-person
figure outside the guarantee. The ε covers the published weights; contributors and rounds are public by the
threat model (docs/design/privacy.md); scores, pay, reputations and refusal reasons are computed from un-noised
deltas, so with DP on they reach their owner only, and the ledger's chain still verifies for everyone."""

from __future__ import annotations

import json

import grpc
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from zoo_gym import codec
from zoo_gym.client.upload import query_signature
from zoo_gym.proto import archive, gym_pb2
from zoo_gym.proto.model_card import model_card, round_summary
from zoo_gym.rewards import verify_chain

PER_PERSON = ("amount", "score", "reputation_after", "reason", "kind")


def _one_dp_round(path, **flags):
    """A server with DP (mean, m = 3) whose round 1 three contributors published: (federation, [(key, id)])."""
    from tests.server.conftest import start_federation

    fed = start_federation(path, aggregator="mean", min_contributors=3, dp_noise_multiplier=1.0, dp_clip=0.05,
                           dp_expected_contributors=3, dp_target_epsilon=1000.0, reward_pool=1000, **flags)
    people = []
    for seed in range(3):
        key, cid = fed.register()
        fed.submit(key, cid, codec.encode(fed.small_delta(seed=seed), codec="fp16"))
        people.append((key, cid))
    fed.wait_published(1)
    return fed, people


@pytest.fixture(scope="module")
def dp_round(tmp_path_factory):
    fed, people = _one_dp_round(tmp_path_factory.mktemp("dp-surfaces") / "state")
    yield fed, people, fed.register(Ed25519PrivateKey.generate())
    fed.stop()


def _ledger(fed, **request) -> list[gym_pb2.LedgerEntry]:
    return list(fed.stub.StreamLedger(gym_pb2.LedgerRequest(**request), timeout=30))


def _verifies(fed, entries) -> bool:
    """The chain check a client runs on what it streamed (entries as rows, the ledger's field names)."""
    rows = [{f.name: getattr(e, f.name) for f in e.DESCRIPTOR.fields} for e in entries]
    rows = [{**r, "contributor": r.pop("contributor_id")} for r in rows]
    return verify_chain(rows, bytes(fed.round().server_public_key)).ok


def test_the_ledger_shows_a_stranger_no_ones_figures_and_still_verifies(dp_round):
    fed, people, (skey, scid) = dp_round
    for entries in (_ledger(fed), _ledger(fed, whole_ledger=True, **query_signature("StreamLedger", skey, scid))):
        assert len(entries) >= 3 and {e.contributor_id for e in entries} >= {cid for _, cid in people}
        assert all(e.redacted and not any(getattr(e, f) for f in PER_PERSON) for e in entries)
        assert _verifies(fed, entries)  # links and signatures still hold


def test_a_contributor_gets_its_own_entries_whole_and_everyone_elses_redacted(dp_round):
    fed, people, _ = dp_round
    (akey, acid), (_, bcid) = people[0], people[1]
    entries = _ledger(fed, whole_ledger=True, **query_signature("StreamLedger", akey, acid))
    mine = [e for e in entries if e.contributor_id == acid]
    others = [e for e in entries if e.contributor_id != acid]
    assert mine and all(not e.redacted and e.kind and e.reputation_after > 0 for e in mine)
    assert others and all(e.redacted and e.amount == 0 and e.score == 0 and e.reason == "" for e in others)
    assert any(e.contributor_id == bcid for e in others)
    assert _verifies(fed, entries)
    # a redacted entry edited on the way no longer verifies: its entry_hash is still signed
    forged = [gym_pb2.LedgerEntry(**{**{f.name: getattr(e, f.name) for f in e.DESCRIPTOR.fields},
                                     "entry_hash": "0" * 64}) if e is others[0] else e for e in entries]
    assert not _verifies(fed, forged)


def test_a_balance_is_shown_to_its_owner_only(dp_round):
    fed, people, (skey, scid) = dp_round
    (akey, acid), (bkey, bcid) = people[0], people[1]
    for request in (gym_pb2.BalanceRequest(contributor_id=bcid),
                    gym_pb2.BalanceRequest(**{**query_signature("GetBalance", akey, acid), "contributor_id": bcid}),
                    gym_pb2.BalanceRequest(**query_signature("GetBalance", skey, scid) | {"contributor_id": bcid})):
        with pytest.raises(grpc.RpcError) as err:
            fed.stub.GetBalance(request, timeout=30)
        assert err.value.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED)
        assert "differential privacy" in err.value.details() or "signature" in err.value.details()
    own = fed.stub.GetBalance(gym_pb2.BalanceRequest(**query_signature("GetBalance", bkey, bcid)), timeout=30)
    assert own.contributor_id == bcid and own.entries >= 1


def test_round_state_lineage_and_card_carry_no_per_person_figure(dp_round):
    fed, people, _ = dp_round
    info = fed.round()
    shown = {f.name for f, _ in info.ListFields()}
    assert not shown & {"score", "amount", "reason", "norm"}  # counts, ε and settings only
    assert info.dp_epsilon_spent > 0
    published = fed.wait_published(1)
    lineage = json.loads((fed.state.checkpoint_dir(info.base_sha256) / archive.LINEAGE).read_text())
    assert published.id == lineage["round"] == 1
    assert set(lineage["contributors"]) == {cid for _, cid in people}  # participation: public by design
    assert "accepted" not in lineage and all(set(s) == {"contributor", "method"} for s in lineage["submissions"])
    text = json.dumps(lineage)
    assert "score" not in text and "norm" not in text and "amount" not in text
    assert lineage["privacy"]["mechanism"] == "mean / fixed m=3" and lineage["privacy"]["participation"] == "public"
    card = model_card([round_summary({"round": 0}, sha256="a" * 64), round_summary(lineage, sha256=info.base_sha256)],
                      base_model="tiny")
    assert "participation public" in card and "scores and pay are outside it and shown to their owner only" in card


def test_gym_client_rewards_verifies_a_dp_ledger_with_its_own_figures(dp_round, tmp_path):
    """What a contributor runs: `gym-client rewards --verify` signs its queries, gets its balance and entries whole,
    and verifies the whole chain through the others' redacted entries."""
    from cryptography.hazmat.primitives import serialization

    from zoo_gym.client.rewards import fetch_rewards

    fed, people, _ = dp_round
    key, cid = people[2]
    key_path = tmp_path / "contributor.pem"
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    doc = fetch_rewards(f"127.0.0.1:{fed.port}", key_path=key_path, contributor=None, limit=10, verify=True,
                        insecure=True, say=lambda _: None)
    assert doc["contributor_id"] == cid and doc["verification"]["ok"], doc["verification"]
    assert doc["recent"] and all(not r["redacted"] and r["contributor_id"] == cid for r in doc["recent"])
    assert doc["balance"] == doc["sum_of_entries"]


@pytest.fixture(scope="module")
def private_round(tmp_path_factory):
    """The same round with participation private: nothing public may say who took part."""
    fed, people = _one_dp_round(tmp_path_factory.mktemp("dp-private") / "state", dp_participation="private")
    yield fed, people
    fed.stop()


def test_with_participation_private_no_surface_names_who_took_part(private_round):
    from zoo_gym.aggregation.privacy import epsilon
    from zoo_gym.server.rounds.privacy_history import published_history

    fed, people = private_round
    info = fed.round()
    ids = {cid for _, cid in people}
    entries = _ledger(fed)
    assert entries and all(e.redacted and e.contributor_id == "" for e in entries) and _verifies(fed, entries)
    lineage = (fed.state.checkpoint_dir(info.base_sha256) / archive.LINEAGE).read_text()
    assert not any(cid in lineage for cid in ids) and "contributors" not in json.loads(lineage)
    with pytest.raises(grpc.RpcError) as err:  # asking for someone's entries would tell whether they exist
        _ledger(fed, contributor_id=people[0][1])
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    key, cid = people[0]
    mine = _ledger(fed, **query_signature("StreamLedger", key, cid))
    assert mine and all(e.contributor_id == cid and not e.redacted for e in mine)
    # add/remove neighbours at the sampling rate (1 here): z itself, not z / 2
    assert info.dp_epsilon_spent == pytest.approx(epsilon([(1.0, 1.0, 1)], delta=1e-5))
    with fed.state.session() as s:
        assert published_history(s) == [(1.0, 1.0, 1)]
    card = model_card([round_summary({"round": 0}, sha256="a" * 64),
                       round_summary(json.loads(lineage), sha256=info.base_sha256)], base_model="tiny")
    assert "contributors: not published (participation private)" in card and "participation private" in card


def test_each_round_is_charged_as_it_was_published(dp_round):
    from zoo_gym.server.rounds.privacy_history import published_history

    fed, _, _ = dp_round
    with fed.state.session() as s:
        assert published_history(s) == [(0.5, 1.0, 1)]  # public: replace-one, z / 2 at q = 1


def test_the_rdp_cross_check_is_stored_at_publish_and_get_round_only_reads_it(dp_round, monkeypatch):
    """Issue 49: the epsilon figures are computed once, when a round publishes, and stored with it (RDP's
    cross-check in dp_epsilon_total_rdp, migration 0007); GetRound reads them and runs no accountant. A round
    published before 0007 (null there) is still answered, from its history, as before."""
    from zoo_gym.aggregation.privacy import rdp_epsilon
    from zoo_gym.server.rounds.privacy_history import published_history
    from zoo_gym.server.store.models import Round
    from zoo_gym.server.transport import handlers

    fed, _, _ = dp_round
    with fed.state.session() as s:
        stored, total = s.get(Round, 1).dp_epsilon_total_rdp, s.get(Round, 1).dp_epsilon_total
        expected = rdp_epsilon(published_history(s), delta=1e-5)
    assert stored is not None and stored == pytest.approx(expected, rel=1e-9) and stored >= total > 0

    def refuse(*args, **kwargs):
        raise AssertionError("GetRound ran the accountant")

    handlers._RDP_CROSS_CHECK.clear()
    monkeypatch.setattr(handlers, "rdp_epsilon", refuse)
    info = fed.round()
    assert info.dp_epsilon_spent_rdp == pytest.approx(stored, rel=1e-6)
    assert info.dp_epsilon_spent == pytest.approx(total, rel=1e-6)
    monkeypatch.undo()

    with fed.state.session() as s:  # as a round published before 0007 left it
        row = s.get(Round, 1)
        row.dp_epsilon_total_rdp = None
        s.add(row)
        s.commit()
    try:
        assert fed.round().dp_epsilon_spent_rdp == pytest.approx(expected, rel=1e-6)
    finally:
        with fed.state.session() as s:
            row = s.get(Round, 1)
            row.dp_epsilon_total_rdp = stored
            s.add(row)
            s.commit()
