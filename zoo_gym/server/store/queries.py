"""Read-only queries behind the dashboard, its JSON API and the metrics collector.

Everything returned is public: ids, names, counts, scores, hashes and times; never a key, a nonce, a
signature secret or a submission's payload. Each function opens its own session and only reads.
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from dataclasses import asdict
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import distinct
from sqlmodel import func, select

from zoo_gym.rewards.ledger import Ledger, LedgerEntry
from zoo_gym.rewards.reputation import Reputation
from zoo_gym.server.store.models import Checkpoint, Contributor, Round, RoundState, Submission

INITIAL_REPUTATION = 0.1  # zoo_gym.rewards.reputation.ReputationConfig.initial: a new identity's value


def _iso(when: datetime | None) -> str | None:
    if when is None:
        return None
    if when.tzinfo is None:  # SQLite hands back naive UTC
        when = when.replace(tzinfo=timezone.utc)
    return when.isoformat(timespec="seconds")


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    start, end = (t.replace(tzinfo=None) if t.tzinfo else t for t in (start, end))
    return round((end - start).total_seconds(), 3)


def summary(state) -> dict[str, Any]:
    """The headline numbers (also the metrics collector's): a few indexed queries."""
    with state.session() as s:
        current = state.current_round(s)
        published = s.exec(select(func.count()).select_from(Round).where(Round.state == RoundState.PUBLISHED)).one()
        subs = s.exec(select(func.count()).select_from(Submission).where(Submission.round_id == current.id)
                      ).one() if current else 0
        eps = s.exec(select(Round.dp_epsilon_total).where(Round.dp_epsilon_total.is_not(None))
                     .order_by(Round.id.desc()).limit(1)).first()
        loss = s.exec(select(Checkpoint.heldout_loss).where(Checkpoint.heldout_loss.is_not(None))
                      .order_by(Checkpoint.round_id.desc()).limit(1)).first()
        contributors = s.exec(select(func.count()).select_from(Contributor)).one()
    return {"current_round": current.id if current else 0,
            "current_state": current.state.value if current else None,
            "current_deadline_unix": current.deadline_unix if current else None,
            "current_message": current.message if current else "",
            "current_submissions": int(subs), "rounds_published": int(published),
            "epsilon_spent": eps, "last_heldout_loss": loss, "contributors": int(contributors)}


def _outcomes(report_json: str) -> tuple[int, int, list[dict]]:
    """(accepted, refused, [{contributor, reason}]) from a round's stored DeltaSoup report."""
    soup = json.loads(report_json or "{}").get("soup") or {}
    rows = soup.get("contributors") or []
    refused = [{"contributor": c.get("contributor"), "reason": c.get("reason") or "refused"}
               for c in rows if not c.get("accepted")]
    return len(rows) - len(refused), len(refused), refused


def rounds(state, *, limit: int = 50, before: int | None = None) -> list[dict]:
    """The newest `limit` rounds (ids below `before` when given), newest first. `accepted`/`refused`: deltas
    the aggregation took into the checkpoint or left out (the report); `paid`/`not_paid`: the ledger's reward
    and refusal entries of the round (a delta in the checkpoint may still go unpaid, e.g. below min quality)."""
    with state.session() as s:
        q = select(Round).order_by(Round.id.desc()).limit(limit)
        if before is not None:
            q = q.where(Round.id < before)
        rows = list(s.exec(q))
        ids = [r.id for r in rows]
        counts = dict(s.exec(select(Submission.round_id, func.count()).where(Submission.round_id.in_(ids))
                             .group_by(Submission.round_id)).all()) if ids else {}
        published = {c.round_id: c for c in s.exec(select(Checkpoint).where(Checkpoint.round_id.in_(ids)))} \
            if ids else {}
        pay: dict[int, dict[str, tuple[int, int]]] = {}  # round -> kind -> (entries, amount): the ledger's verdicts
        for rid, kind, n, amount in (s.exec(select(LedgerEntry.round_id, LedgerEntry.kind, func.count(),
                                                   func.sum(LedgerEntry.amount))
                                            .where(LedgerEntry.round_id.in_(ids))
                                            .group_by(LedgerEntry.round_id, LedgerEntry.kind)).all() if ids else []):
            pay.setdefault(rid, {})[kind] = (int(n), int(amount or 0))
    out = []
    for r in rows:
        accepted, refused, reasons = _outcomes(r.report_json)
        ckpt = published.get(r.id)
        settled = pay.get(r.id)  # None: no ledger entry (not settled, or nothing scored)
        out.append({
            "id": r.id, "state": r.state.value, "opened_at": _iso(r.opened_at),
            "deadline_unix": r.deadline_unix or None, "closed_at": _iso(r.closed_at),
            "published_at": _iso(ckpt.created_at) if ckpt else None,
            "submissions": int(counts.get(r.id, 0)), "accepted": accepted if r.state == RoundState.PUBLISHED else None,
            "refused": refused if r.state == RoundState.PUBLISHED else None, "refusals": reasons,
            "paid": settled.get("reward", (0, 0))[0] if settled else None,
            "paid_amount": settled.get("reward", (0, 0))[1] if settled else None,
            "not_paid": settled.get("refusal", (0, 0))[0] if settled else None,
            "aggregator": r.aggregator, "seconds_open": _seconds(r.opened_at, r.closed_at),
            "seconds_to_publish": _seconds(r.closed_at, ckpt.created_at) if ckpt else None,
            "heldout_loss": ckpt.heldout_loss if ckpt else None, "published_sha256": r.published_sha256,
            "dp_epsilon_round": r.dp_epsilon_round, "dp_epsilon_total": r.dp_epsilon_total,
            # a note on why the round waits or stopped; a closed round's outcome is its row (rounds closed
            # before the note was cleared at close still hold a stale "timed out ... reopened until ...")
            "message": r.message if r.state in (RoundState.OPEN, RoundState.HALTED) else "",
        })
    return out


def loss_series(state) -> list[dict]:
    """Held-out loss of every published checkpoint, by round (0 = genesis)."""
    with state.session() as s:
        rows = s.exec(select(Checkpoint.round_id, Checkpoint.heldout_loss).order_by(Checkpoint.round_id)).all()
    return [{"round": r, "heldout_loss": loss} for r, loss in rows]


def privacy_series(state) -> list[dict]:
    """Epsilon spent after each round that published under DP."""
    with state.session() as s:
        rows = s.exec(select(Round.id, Round.dp_epsilon_round, Round.dp_epsilon_total, Round.dp_sample_rate)
                      .where(Round.dp_epsilon_total.is_not(None)).order_by(Round.id)).all()
    return [{"round": r, "epsilon_round": e, "epsilon_total": t, "sample_rate": q} for r, e, t, q in rows]


def checkpoints(state, *, limit: int = 50) -> list[dict]:
    """The lineage, newest first: each published checkpoint and the one it was trained from."""
    with state.session() as s:
        rows = list(s.exec(select(Checkpoint).order_by(Checkpoint.round_id.desc()).limit(limit)))
    return [{"round": c.round_id, "sha256": c.sha256, "parent_sha256": c.parent_sha256, "bytes": c.size,
             "heldout_loss": c.heldout_loss, "created_at": _iso(c.created_at)} for c in rows]


def leaderboard(state, *, limit: int = 100) -> list[dict]:
    """Contributors by balance: display name, balance, reputation, rounds contributed."""
    with state.session() as s:
        balances = dict(s.exec(select(LedgerEntry.contributor, func.sum(LedgerEntry.amount))
                               .group_by(LedgerEntry.contributor)).all())
        rounds_in = dict(s.exec(select(Submission.contributor_id, func.count(distinct(Submission.round_id)))
                                .group_by(Submission.contributor_id)).all())
        reps = dict(s.exec(select(Reputation.contributor, Reputation.value)).all())
        people = s.exec(select(Contributor.id, Contributor.display_name, Contributor.registered_at)).all()
    board = [{"contributor_id": cid, "display_name": name, "balance": int(balances.get(cid) or 0),
              "reputation": float(reps.get(cid, INITIAL_REPUTATION)), "rounds": int(rounds_in.get(cid, 0)),
              "registered_at": _iso(at)} for cid, name, at in people]
    board.sort(key=lambda b: (-b["balance"], -b["reputation"], -b["rounds"], b["contributor_id"]))
    return board[:limit]


def _entry(e: LedgerEntry) -> dict:
    return {"seq": e.seq, "round_id": e.round_id, "contributor_id": e.contributor, "kind": e.kind,
            "amount": e.amount, "score": e.score, "reputation_after": e.reputation_after, "reason": e.reason,
            "entry_hash": e.entry_hash}


def ledger(state, *, limit: int = 50, contributor: str | None = None) -> list[dict]:
    """The newest ledger entries, newest first."""
    with state.session() as s:
        q = select(LedgerEntry).order_by(LedgerEntry.seq.desc()).limit(limit)
        if contributor is not None:
            q = q.where(LedgerEntry.contributor == contributor)
        return [_entry(e) for e in s.exec(q)]


PROGRESS_EVERY = 5000  # entries between two `progress` calls of verify_ledger


def verify_ledger(state, *, progress=None) -> dict[str, Any]:
    """`gym-server ledger verify`: the whole hash chain and every signature (`rewards.verify.VerifyReport` as a
    dict: ok, checked, first_bad_seq, reason), read 1000 entries at a time; `progress(checked)` is called every
    PROGRESS_EVERY entries when given."""
    from sqlmodel import Session

    from zoo_gym.rewards.verify import verify_chain

    ledger = Ledger(lambda: Session(state.engine, expire_on_commit=False), state.key)
    if progress is None:
        return asdict(ledger.verify())

    def counted():
        for i, entry in enumerate(ledger.iter_entries(), 1):
            if i % PROGRESS_EVERY == 0:
                progress(i)
            yield entry

    return asdict(verify_chain(counted(), ledger.public_key))


def ledger_size(state) -> int:
    with state.session() as s:
        return int(s.exec(select(func.count()).select_from(LedgerEntry)).one())


class LedgerCheck:
    """`gym-server ledger verify` (the whole chain and every signature) for the page.

    Run again when the ledger's size, head or total changes, and in the background when the last run is older
    than `max_age` seconds (so an edit that keeps all three shows within that time): a page load must not re-check
    10 000 signatures every time. Entries appended after the last verdict, the ones before them unchanged in
    count, total and head, are verified in the background from that head (`pending` says how many are being
    checked): a round that adds 10,000 entries does not hold the next page for their signatures. Any other
    change (an edit, a deletion) is verified at once, the whole chain."""

    def __init__(self, state, *, max_age: float = 60.0) -> None:
        self.state, self.max_age = state, max_age
        self._lock = threading.Lock()
        self._key: tuple | None = None  # (count, max seq, total, head hash) the report speaks for
        self._report: dict | None = None
        self._at = 0.0
        self._refreshing = False

    def _fingerprint(self, s=None, *, upto: int | None = None) -> tuple:
        if s is None:
            with self.state.session() as s:
                return self._fingerprint(s, upto=upto)
        q = select(func.count(), func.max(LedgerEntry.seq), func.sum(LedgerEntry.amount)).select_from(LedgerEntry)
        h = select(LedgerEntry.entry_hash).order_by(LedgerEntry.seq.desc()).limit(1)
        if upto is not None:
            q, h = q.where(LedgerEntry.seq <= upto), h.where(LedgerEntry.seq <= upto)
        return (*tuple(s.exec(q).one()), s.exec(h).first())

    def _run(self, key: tuple) -> None:
        report = verify_ledger(self.state)
        with self._lock:
            self._report, self._key, self._at, self._refreshing = report, key, time.monotonic(), False

    def _appended(self, key: tuple) -> bool:
        """Whether the ledger only grew since the last verdict, which was good: the entries up to its head
        still count, sum and end as they did."""
        old = self._key
        if old is None or not self._report or not self._report["ok"] or not key[1] or key[0] <= old[0]:
            return False
        if not old[0]:  # it was empty: every entry is new
            return True
        return key[1] > old[1] and self._fingerprint(upto=old[1]) == old

    def _extend(self, old: tuple, key: tuple) -> None:
        """Verify the entries after `old`'s head up to `key`'s, then speak for `key` (or run the whole chain)."""
        from sqlmodel import Session

        from zoo_gym.rewards.entry_hash import GENESIS_HASH
        from zoo_gym.rewards.verify import verify_chain

        ledger = Ledger(lambda: Session(self.state.engine, expire_on_commit=False), self.state.key)
        new = itertools.takewhile(lambda e: e.seq <= key[1], ledger.iter_entries(since_seq=old[1] or 0))
        start = (old[1], old[3]) if old[0] else (0, GENESIS_HASH)
        part = asdict(verify_chain(new, ledger.public_key, start=start, expected_head=(key[1], key[3])))
        if not part["ok"]:
            self._run(key)  # name the first bad entry of the whole chain
            return
        with self._lock:
            if self._key == old:  # else another check spoke meanwhile: its count already holds these entries
                self._report = {**part, "checked": self._report["checked"] + part["checked"]}
                self._key, self._at = key, time.monotonic()
            self._refreshing = False

    def report(self) -> dict:
        key = self._fingerprint()
        with self._lock:
            fresh = key == self._key
            if fresh and time.monotonic() - self._at > self.max_age and not self._refreshing:
                self._refreshing = True
                threading.Thread(target=self._run, args=(key,), name="ledger-check", daemon=True).start()
            if fresh:
                return dict(self._report)
            old = self._key
        if self._appended(key):
            with self._lock:
                if self._key == key:  # a background check reached this head since `old` was read
                    return dict(self._report)
                # from the verdict still standing only: one started from a stale `old` after another check had
                # moved on would count the same entries twice
                if not self._refreshing and self._key == old:
                    self._refreshing = True
                    threading.Thread(target=self._extend, args=(old, key), name="ledger-check", daemon=True).start()
                return {**self._report, "pending": key[0] - self._key[0]}
        self._run(key)  # changed otherwise (or first): the page waits for the verdict on what it shows
        with self._lock:
            return dict(self._report)


def contributor(state, contributor_id: str) -> dict | None:
    """One contributor's public record: submissions (with the round's verdict and score), ledger entries."""
    with state.session() as s:
        person = s.get(Contributor, contributor_id)
        if person is None:
            return None
        subs = list(s.exec(select(Submission).where(Submission.contributor_id == contributor_id)
                           .order_by(Submission.round_id.desc())))
        reports = {r.id: r.report_json for r in s.exec(select(Round).where(Round.id.in_([x.round_id for x in subs])))}
        rep = s.get(Reputation, contributor_id)
    entries = ledger(state, limit=10_000, contributor=contributor_id)
    rows = []
    for sub in subs:
        verdict = _verdict(reports.get(sub.round_id, "{}"), contributor_id)
        rows.append({"round": sub.round_id, "bytes": sub.payload_size, "codecs": sub.codecs,
                     "payload_sha256": sub.payload_sha256, "received_at": _iso(sub.received_at), **verdict})
    return {"contributor_id": person.id, "display_name": person.display_name,
            "registered_at": _iso(person.registered_at), "balance": sum(e["amount"] for e in entries),
            "reputation": rep.value if rep else INITIAL_REPUTATION, "submissions": rows, "ledger": entries,
            "refusals": [r for r in rows if r["accepted"] is False]}


def _verdict(report_json: str, contributor_id: str) -> dict:
    report = json.loads(report_json or "{}")
    soup = next((c for c in (report.get("soup") or {}).get("contributors") or []
                 if c.get("contributor") == contributor_id), None)
    score = next((c for c in (report.get("rewards") or {}).get("scores") or []
                  if c.get("contributor") == contributor_id), None)
    return {"accepted": None if soup is None else bool(soup.get("accepted")),
            "refusal": soup.get("reason") if soup else None,
            "score": score.get("score") if score else None,
            "score_reason": score.get("reason") if score else None}
