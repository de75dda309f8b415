"""The dashboard's JSON API and pages show the real round: verdicts with reasons, the loss, the leaderboard,
the verified ledger, the lineage and a contributor's own page; nothing secret is on them."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient
from sqlmodel import select

from zoo_gym.dashboard import create_app
from zoo_gym.rewards.ledger import LedgerEntry
from zoo_gym.server.store.models import Checkpoint, Contributor, UsedNonce


@pytest.fixture(scope="module")
def web(one_round):
    return TestClient(create_app(one_round["fed"].state, registry=one_round["fed"].rounds.metrics.registry,
                                 dp_target_epsilon=8.0))


def test_rounds_api_has_verdicts_and_reasons(one_round, web):
    rounds = web.get("/api/rounds").json()
    assert [r["id"] for r in rounds] == [2, 1]
    r1 = rounds[1]
    assert (r1["state"], r1["submissions"], r1["accepted"], r1["refused"]) == ("published", 3, 2, 1)
    refused_cid = one_round["people"][2][1]
    assert r1["refusals"][0]["contributor"] == refused_cid and "max_norm_ratio" in r1["refusals"][0]["reason"]
    assert r1["aggregator"] == "mean" and r1["seconds_to_publish"] >= 0 and r1["deadline_unix"] > 0
    assert rounds[0]["state"] == "open" and rounds[0]["accepted"] is None
    assert web.get("/api/rounds", params={"before": 2}).json()[0]["id"] == 1
    assert web.get("/api/rounds", params={"limit": 0}).status_code == 422


def test_rounds_table_separates_the_checkpoint_from_the_pay_as_the_ledger_does(one_round, web):
    """Accepted into the checkpoint (the aggregation's report) is not paid (the ledger): each has its column."""
    with one_round["fed"].state.session() as s:
        kinds = [e.kind for e in s.exec(select(LedgerEntry).where(LedgerEntry.round_id == 1))]
        paid_units = sum(e.amount for e in s.exec(select(LedgerEntry).where(LedgerEntry.round_id == 1)))
    r1 = web.get("/api/rounds").json()[1]
    assert (r1["paid"], r1["not_paid"]) == (kinds.count("reward"), kinds.count("refusal"))
    assert r1["paid_amount"] == paid_units and r1["paid"] + r1["not_paid"] == r1["submissions"] == 3
    assert web.get("/api/rounds").json()[0]["paid"] is None  # round 2 is open: nothing settled
    page = web.get("/").text
    assert "<th>in checkpoint</th><th>left out</th>" in page and "<th>paid</th><th>not paid</th>" in page
    row = page.split('<tr data-round="1">')[1].split("</tr>")[0]
    assert f'<td class="paid">{r1["paid"]}' in row and f'<td class="unpaid">{r1["not_paid"]}</td>' in row


def test_a_published_round_no_longer_shows_why_it_waited(federation_with):
    """A round that timed out with no submissions says so while it is open; once published it does not."""
    import re
    import time

    from zoo_gym import codec
    from zoo_gym.server.store.models import Round

    fed = federation_with(min_contributors=2, round_timeout=1.0, aggregator="mean", validation_examples=0)
    web = TestClient(create_app(fed.state))
    deadline = time.monotonic() + 60
    while "timed out with 0 submissions" not in web.get("/api/rounds").json()[0]["message"]:
        assert time.monotonic() < deadline, "round 1 did not time out within 60 s"
        time.sleep(0.2)
    assert "reopened until" in web.get("/").text  # open: the note is what people should see
    for seed in range(2):
        key, cid = fed.register()
        fed.submit(key, cid, codec.encode(fed.small_delta(seed=seed), codec="fp16"))
    fed.wait_published(1)
    r1 = next(r for r in web.get("/api/rounds").json() if r["id"] == 1)
    assert r1["state"] == "published" and r1["message"] == "" and r1["published_sha256"]
    with fed.state.session() as s:
        assert s.get(Round, 1).message == ""  # cleared when it closed: `gym-server status` agrees
    row = re.search(r'<tr data-round="1">.*?</tr>\s*(<tr class="message">)?', web.get("/").text, re.S)
    assert row.group(1) is None


def test_loss_leaderboard_ledger_lineage(one_round, web):
    state = one_round["fed"].state
    with state.session() as s:
        ckpts = {c.round_id: c for c in s.exec(select(Checkpoint))}
        entries = list(s.exec(select(LedgerEntry)))
    assert web.get("/api/loss").json() == [{"round": r, "heldout_loss": ckpts[r].heldout_loss} for r in (0, 1)]
    assert web.get("/api/privacy").json() == {"target": 8.0, "rounds": []}
    board = web.get("/api/leaderboard").json()
    assert sorted(b["contributor_id"] for b in board) == sorted(cid for _, cid in one_round["people"])
    for b in board:
        mine = [e for e in entries if e.contributor == b["contributor_id"]]
        assert b["balance"] == sum(e.amount for e in mine) and b["rounds"] == 1 and b["display_name"] == "test"
        assert b["reputation"] == pytest.approx(mine[-1].reputation_after)
    ledger = web.get("/api/ledger").json()
    assert ledger["verification"]["ok"] and ledger["verification"]["checked"] == len(entries) == 3
    assert [e["seq"] for e in ledger["entries"]] == [3, 2, 1]
    lineage = web.get("/api/checkpoints").json()
    assert [(c["round"], c["parent_sha256"]) for c in lineage] == [(1, ckpts[0].sha256), (0, None)]
    summary = web.get("/api/summary").json()
    assert (summary["current_round"], summary["rounds_published"], summary["contributors"]) == (2, 1, 3)


def test_ledger_tampering_shows_broken(one_round, tmp_path):
    """The same verification as `gym-server ledger verify`: an edited amount is named, not hidden by a cache."""
    state = one_round["fed"].state
    web = TestClient(create_app(state))
    assert web.get("/api/ledger").json()["verification"]["ok"]
    with state.session() as s:
        e = s.get(LedgerEntry, 2)
        e.amount += 5
        s.add(e)
        s.commit()
    try:
        report = web.get("/api/ledger").json()["verification"]
        assert not report["ok"] and report["first_bad_seq"] == 2
        assert "BROKEN at entry 2" in web.get("/").text
    finally:
        with state.session() as s:
            e = s.get(LedgerEntry, 2)
            e.amount -= 5
            s.add(e)
            s.commit()
    assert web.get("/api/ledger").json()["verification"]["ok"]


def test_contributor_page_and_api(one_round, web):
    cid = one_round["people"][2][1]
    me = web.get(f"/api/contributors/{cid}").json()
    assert me["submissions"][0]["round"] == 1 and me["submissions"][0]["accepted"] is False
    assert "max_norm_ratio" in me["refusals"][0]["refusal"]
    assert [e["kind"] for e in me["ledger"]] == ["refusal"]
    page = web.get(f"/contributors/{cid}")
    assert page.status_code == 200 and "refused" in page.text and "max_norm_ratio" in page.text
    assert web.get("/api/contributors/" + "0" * 32).status_code == 404
    assert web.get("/api/contributors/not-an-id").status_code == 404


def test_pages_show_nothing_secret(one_round, web):
    state = one_round["fed"].state
    from cryptography.hazmat.primitives import serialization

    private = state.key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                                      serialization.NoEncryption()).hex()
    with state.session() as s:
        keys = [c.public_key for c in s.exec(select(Contributor))]
        nonces = [n.nonce for n in s.exec(select(UsedNonce))]
        signatures = [e.signature for e in s.exec(select(LedgerEntry))]
    cid = one_round["people"][0][1]
    texts = [web.get(p).text for p in ("/", f"/contributors/{cid}", "/api/rounds", "/api/ledger",
                                       "/api/leaderboard", f"/api/contributors/{cid}", "/api/checkpoints")]
    for secret in [private, *keys, *nonces, *signatures]:
        assert all(secret not in t for t in texts)


def test_page_shows_the_round_and_refreshes_while_open(one_round, web):
    page = web.get("/").text
    assert 'http-equiv="refresh"' in page  # round 2 is open
    assert 'id="loss-chart"' in page and 'data-round="1"' in page
    assert 'href="/static/style.css"' in page and "http://" not in page.split("<body>")[0]  # no CDN
    assert web.get("/static/style.css").status_code == 200


def test_an_edit_that_keeps_size_head_and_total_shows_within_max_age(one_round):
    """A changed reason keeps the cheap fingerprint; the periodic re-verification still names the entry."""
    import time

    from zoo_gym.server.store.queries import LedgerCheck

    state = one_round["fed"].state
    check = LedgerCheck(state, max_age=0.0)
    assert check.report()["ok"]
    with state.session() as s:
        e = s.get(LedgerEntry, 1)
        original, e.reason = e.reason, e.reason + " (edited)"
        s.add(e)
        s.commit()
    try:
        deadline = time.monotonic() + 30
        report = check.report()
        while report["ok"] and time.monotonic() < deadline:
            time.sleep(0.05)
            report = check.report()
        assert not report["ok"] and report["first_bad_seq"] == 1
    finally:
        with state.session() as s:
            e = s.get(LedgerEntry, 1)
            e.reason = original
            s.add(e)
            s.commit()


def test_appended_entries_are_checked_in_the_background_and_an_edit_at_once(one_round):
    """A round's new entries (the old ones unchanged) do not hold the page for their signatures: the last verdict
    with `pending`, then the whole ledger verified; an edit of an old entry made with them is named at once."""
    import time

    from sqlmodel import Session

    from zoo_gym.rewards.ledger import Ledger, NewEntry
    from zoo_gym.server.store.queries import LedgerCheck

    state = one_round["fed"].state
    check = LedgerCheck(state)
    before = check.report()
    assert before["ok"] and "pending" not in before
    stale = check._key  # noqa: SLF001 - the verdict the appended entries extend
    ledger = Ledger(lambda: Session(state.engine, expire_on_commit=False), state.key)
    original = None
    ledger.append([NewEntry(round_id=1, contributor="c" * 32, kind="reward", amount=1, score=0.1,
                            reputation_after=0.2, reason="test") for _ in range(40)])
    try:
        first = check.report()
        assert first["ok"] and first["checked"] == before["checked"] and first["pending"] == 40
        deadline = time.monotonic() + 30
        report = check.report()
        while "pending" in report and time.monotonic() < deadline:
            time.sleep(0.05)
            report = check.report()
        assert report["ok"] and report["checked"] == before["checked"] + 40 and "pending" not in report
        # a second background check started from the same old verdict (the race CI met: a page load that read
        # the old head just before the first check ended) must not count the 40 entries again
        check._extend(stale, check._fingerprint())  # noqa: SLF001
        assert check.report()["checked"] == before["checked"] + 40
        with state.session() as s:
            e = s.get(LedgerEntry, 2)
            original, e.amount = e.amount, e.amount + 5
            s.add(e)
            s.commit()
        ledger.append([NewEntry(round_id=1, contributor="c" * 32, kind="reward", amount=1, score=0.1,
                                reputation_after=0.2, reason="test")])
        edited = check.report()
        assert not edited["ok"] and edited["first_bad_seq"] == 2 and "pending" not in edited
    finally:
        with state.session() as s:
            for extra in s.exec(select(LedgerEntry).where(LedgerEntry.reason == "test")):
                s.delete(extra)
            if original is not None:
                e = s.get(LedgerEntry, 2)
                e.amount = original
                s.add(e)
            s.commit()
    assert check.report()["ok"]


def test_a_ledger_that_was_empty_is_checked_in_the_background_once_filled(federation_with):
    """The dashboard starts with the server, on an empty ledger: the first round's entries are all appended ones
    (the 10,000-contributor round's first page waited 1.6 s for them)."""
    import time

    from sqlmodel import Session

    from zoo_gym.rewards.ledger import Ledger, NewEntry
    from zoo_gym.server.store.queries import LedgerCheck

    fed = federation_with(min_contributors=2, aggregator="mean", validation_examples=0)
    check = LedgerCheck(fed.state)
    empty = check.report()
    assert empty["ok"] and empty["checked"] == 0 and "pending" not in empty
    ledger = Ledger(lambda: Session(fed.state.engine, expire_on_commit=False), fed.state.key)
    ledger.append([NewEntry(round_id=1, contributor="c" * 32, kind="reward", amount=1, score=0.1,
                            reputation_after=0.2, reason="test") for _ in range(40)])
    first = check.report()
    assert first["ok"] and first["checked"] == 0 and first["pending"] == 40
    deadline = time.monotonic() + 30
    report = check.report()
    while "pending" in report and time.monotonic() < deadline:
        time.sleep(0.05)
        report = check.report()
    assert report["ok"] and report["checked"] == 40 and "pending" not in report