"""The signed hash-chained ledger: appends, balances, and tamper detection through raw SQL."""

from __future__ import annotations

import hashlib
import json

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlalchemy import text
from sqlalchemy.pool import StaticPool
from sqlmodel import Session, create_engine

from zoo_gym.rewards import (GENESIS_HASH, Ledger, LedgerError, NewEntry, canonical_entry_bytes,
                             compute_entry_hash, create_ledger_tables, signing_message,
                             verify_chain, verify_entries)

KEY = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
DATABASES = ("sqlite", "postgresql")  # tests using `engine` run on both (tests/conftest.py)


@pytest.fixture
def engine(db_url):
    if db_url is None:
        eng = create_engine("sqlite://", connect_args={"check_same_thread": False}, poolclass=StaticPool)
    else:
        from zoo_gym.server.store.engine import make_engine

        eng = make_engine(db_url)
    create_ledger_tables(eng)
    yield eng
    eng.dispose()


@pytest.fixture
def ledger(engine):
    return Ledger(lambda: Session(engine), KEY)


def _entries(round_id: int) -> list[NewEntry]:
    return [NewEntry(round_id=round_id, contributor="aa", kind="reward", amount=60, score=0.5,
                     reputation_after=0.28, reason="paid"),
            NewEntry(round_id=round_id, contributor="bb", kind="reward", amount=40, score=0.25,
                     reputation_after=0.2, reason="paid"),
            NewEntry(round_id=round_id, contributor="cc", kind="refusal", amount=0, score=0.0,
                     reputation_after=0.05, reason="held-out loss did not improve")]


def _fill(ledger: Ledger, rounds: int = 3) -> None:
    for r in range(rounds):
        ledger.append(_entries(r))


def test_canonical_bytes_are_exactly_specified():
    entry = dict(seq=1, round_id=0, contributor="aa", kind="reward", amount=60, score=0.5,
                 reputation_after=0.1, reason="é", prev_hash=GENESIS_HASH)
    expected = ('{"amount":60,"contributor":"aa","kind":"reward","prev_hash":"' + GENESIS_HASH +
                '","reason":"\\u00e9","reputation_after":0.1,"round_id":0,"score":0.5,"seq":1,'
                '"v":1}').encode()
    assert canonical_entry_bytes(entry) == expected
    assert compute_entry_hash(entry) == hashlib.sha256(expected).hexdigest()
    # Ints arriving as floats (JSON / protobuf round trips) and vice versa encode the same.
    same = dict(entry, score=0.5, amount=60.0, seq=1.0)
    assert canonical_entry_bytes(same) == expected
    assert json.loads(expected)["reputation_after"] == 0.1


def test_append_chains_signs_and_numbers_densely(ledger):
    _fill(ledger, 2)
    got = ledger.entries()
    assert [e.seq for e in got] == [1, 2, 3, 4, 5, 6]
    assert got[0].prev_hash == GENESIS_HASH
    for prev, cur in zip(got, got[1:]):
        assert cur.prev_hash == prev.entry_hash
    for e in got:
        assert e.entry_hash == compute_entry_hash(e)
        KEY.public_key().verify(bytes.fromhex(e.signature), signing_message(e.entry_hash))
    report = verify_chain(got, KEY.public_key())
    assert (report.ok, report.checked, report.head_seq) == (True, 6, 6)
    assert ledger.head() == (6, got[-1].entry_hash)


def test_balance_equals_sum_of_entries_and_filters(ledger):
    _fill(ledger, 3)
    assert ledger.balance("aa") == 180
    assert ledger.balance("bb") == 120
    assert ledger.balance("cc") == 0
    assert ledger.balance("nobody") == 0
    for who in ("aa", "bb", "cc"):
        assert ledger.balance(who) == sum(e.amount for e in ledger.entries(contributor=who))
    assert [e.seq for e in ledger.entries(contributor="bb", since_seq=2)] == [5, 8]
    assert [e.seq for e in ledger.entries(limit=2, newest_first=True)] == [9, 8]
    assert [e.seq for e in ledger.iter_entries(batch_size=4)] == list(range(1, 10))


def test_bad_entries_are_refused_before_anything_is_written(ledger):
    with pytest.raises(LedgerError, match="refusal"):
        NewEntry(round_id=0, contributor="aa", kind="refusal", amount=5, score=0.0,
                 reputation_after=0.1)
    with pytest.raises(LedgerError, match="kind"):
        NewEntry(round_id=0, contributor="aa", kind="gift", amount=5, score=0.0,
                 reputation_after=0.1)
    with pytest.raises(LedgerError, match="finite"):
        NewEntry(round_id=0, contributor="aa", kind="reward", amount=5, score=float("nan"),
                 reputation_after=0.1)
    assert ledger.entries() == []


def test_clean_ledger_verifies(ledger):
    _fill(ledger)
    assert ledger.verify().ok


def _tamper(engine, sql: str, **params) -> None:
    with engine.begin() as conn:
        conn.execute(text(sql), params)


def test_edited_amount_is_detected(engine, ledger):
    _fill(ledger)
    _tamper(engine, "UPDATE ledger_entry SET amount = 1000 WHERE seq = 5")
    report = ledger.verify()
    assert (report.ok, report.first_bad_seq, report.checked) == (False, 5, 4)
    assert "entry_hash mismatch" in report.reason


def test_edited_amount_with_recomputed_hash_fails_the_signature(engine, ledger):
    _fill(ledger)
    e = ledger.entries()[4]
    forged = compute_entry_hash(dict(e.model_dump(), amount=1000))
    _tamper(engine, "UPDATE ledger_entry SET amount = 1000, entry_hash = :h WHERE seq = 5", h=forged)
    report = ledger.verify()
    assert (report.ok, report.first_bad_seq) == (False, 5)
    assert "bad signature" in report.reason


def test_deleted_entry_is_detected(engine, ledger):
    _fill(ledger)
    _tamper(engine, "DELETE FROM ledger_entry WHERE seq = 4")
    report = ledger.verify()
    assert (report.ok, report.first_bad_seq, report.checked) == (False, 4, 3)
    assert "gap" in report.reason


def test_swapped_entries_are_detected(engine, ledger):
    _fill(ledger)
    # Exchange the seq numbers of entries 4 and 5 (a reorder of two rows).
    _tamper(engine, "UPDATE ledger_entry SET seq = -1 WHERE seq = 4")
    _tamper(engine, "UPDATE ledger_entry SET seq = 4 WHERE seq = 5")
    _tamper(engine, "UPDATE ledger_entry SET seq = 5 WHERE seq = -1")
    report = ledger.verify()
    assert (report.ok, report.first_bad_seq) == (False, 4)
    assert "prev_hash" in report.reason


def test_swapped_contents_are_detected(engine, ledger):
    _fill(ledger)
    # Exchange the contributor of two entries (who got paid what).
    _tamper(engine, "UPDATE ledger_entry SET contributor = 'zz' WHERE seq = 7")
    _tamper(engine, "UPDATE ledger_entry SET contributor = 'aa' WHERE seq = 8")
    _tamper(engine, "UPDATE ledger_entry SET contributor = 'bb' WHERE seq = 7")
    report = ledger.verify()
    assert (report.ok, report.first_bad_seq) == (False, 7)


def test_truncated_tail_needs_a_kept_head(engine, ledger):
    _fill(ledger)
    head = ledger.head()
    _tamper(engine, "DELETE FROM ledger_entry WHERE seq = 9")
    assert ledger.verify().ok  # a shorter chain is self-consistent ...
    report = ledger.verify(expected_head=head)  # ... but not with the head a client kept
    assert (report.ok, report.first_bad_seq) == (False, 9)


def test_other_server_key_fails(ledger):
    _fill(ledger, 1)
    other = Ed25519PrivateKey.from_private_bytes(bytes(32)).public_key()
    report = verify_chain(ledger.entries(), other)
    assert (report.ok, report.first_bad_seq) == (False, 1)
    assert "bad signature" in report.reason


def test_client_verifies_its_own_entries_from_dicts(engine, ledger):
    _fill(ledger)
    mine = [e.model_dump() for e in ledger.entries(contributor="bb")]  # as received over the wire
    pub_hex = KEY.public_key().public_bytes_raw().hex()
    report = verify_entries(mine, pub_hex)
    assert (report.ok, report.checked) == (True, 3)
    mine[1]["amount"] = 41
    report = verify_entries(mine, pub_hex)
    assert (report.ok, report.first_bad_seq) == (False, 5)
    report = verify_entries([mine[2], mine[0]], pub_hex)
    assert (report.ok, report.first_bad_seq) == (False, 2)
