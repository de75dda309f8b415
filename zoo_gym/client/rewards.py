"""`gym-client rewards`: balance, reputation and ledger entries, verified against the server's key.

With `--verify` the server's key is pinned per server address in the known-servers file
(zoo_gym/client/known_servers.py): trusted on first use, said so, and refused later if it changes. The
server's signed ledger head (entry count and last hash) is checked, the ledger from the last head this
client verified up to the new one is streamed and checked entry by entry (hash, signature, links), and
the new head is remembered. A later answer with fewer entries than a head already verified, or another
entry at its seq (a rewritten chain), gives ok=false with the reason. `own_entries` and `payout` give
`gym-client join` each round's pay and its reason, from the same signed query.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import grpc

from zoo_gym.client import known_servers
from zoo_gym.client.connection import TransportMismatch, open_stub, transport_mismatch
from zoo_gym.client.known_servers import UntrustedServer
from zoo_gym.client.server_signatures import verify_ledger_head
from zoo_gym.client.upload import query_signature
from zoo_gym.proto import gym_pb2, signing
from zoo_gym.rewards import verify_entries


class RewardsError(RuntimeError):
    """Cannot answer the rewards query; the message says why."""


def legacy_pin_path(key_path: Path) -> Path:
    """Where clients before the known-servers file pinned one server per contributor key."""
    return Path(str(key_path) + ".server.pub")


def _row(e) -> dict:
    return {"seq": e.seq, "round_id": e.round_id, "contributor": e.contributor_id, "kind": e.kind,
            "amount": e.amount, "score": e.score, "reputation_after": e.reputation_after, "reason": e.reason,
            "prev_hash": e.prev_hash, "entry_hash": e.entry_hash, "signature": e.signature, "redacted": e.redacted}


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)


def fetch_rewards(server: str, *, key_path: Path, contributor: str | None, limit: int, verify: bool,
                  root_certificates: str | None = None, insecure: bool = False,
                  say: Callable[[str], None] = _stderr) -> dict:
    key = None
    if Path(key_path).exists():  # signs the queries, so a server with DP shows this contributor its own figures
        key, _ = signing.load_or_create_key(key_path)
    elif contributor is None:
        raise RewardsError(f"no key at {key_path}: pass --contributor ID or --key PATH")
    own = signing.contributor_id(signing.public_bytes(key)) if key is not None else None
    contributor = contributor or own
    def asked(method: str) -> dict:  # noqa: E306 - signed only for the key's own contributor
        return query_signature(method, key, contributor) if key is not None and own == contributor else \
            {"contributor_id": contributor}
    known = known_servers.for_key(Path(key_path))
    try:
        pinned = known.get(server) if verify else None
    except UntrustedServer as exc:  # a damaged known_servers line
        raise RewardsError(str(exc)) from None
    channel, stub = open_stub(server, root_certificates=root_certificates, insecure=insecure)
    try:
        info = stub.GetRound(gym_pb2.GetRoundRequest(), timeout=30)
        head = stub.GetLedgerHead(gym_pb2.LedgerHeadRequest(), timeout=30) if verify else None
        balance = stub.GetBalance(gym_pb2.BalanceRequest(**asked("GetBalance")), timeout=30)
        entries = [e for e in stub.StreamLedger(gym_pb2.LedgerRequest(**asked("StreamLedger")), timeout=60)]
        segment = None
        if head is not None:
            since = pinned.head_entries if pinned is not None and pinned.head_entries else 0
            since = max(0, min(since, head.entries) - 1)  # from the remembered head itself, to compare it
            want = head.entries - since
            whole = asked("StreamLedger")
            whole = {**whole, "whole_ledger": True} if "signature" in whole else {}
            segment = [_row(e) for e in stub.StreamLedger(gym_pb2.LedgerRequest(since_seq=since, limit=want, **whole),
                                                          timeout=60)] if want > 0 else []
    except grpc.RpcError as exc:
        problem = transport_mismatch(exc)
        if problem:
            raise TransportMismatch(f"cannot connect securely: {problem}") from exc
        raise
    finally:
        channel.close()
    rows = [_row(e) for e in entries]
    doc = {"contributor_id": contributor, "balance": balance.balance, "reputation": balance.reputation,
           "entries": balance.entries, "sum_of_entries": sum(r["amount"] for r in rows),
           "recent": [{**r, "contributor_id": r.pop("contributor")} for r in [dict(x) for x in rows[-limit:]]]}
    if verify:
        try:
            server_key = known.trust(server, bytes(info.server_public_key), say=say,
                                     legacy=legacy_pin_path(Path(key_path)))
        except UntrustedServer as exc:
            raise RewardsError(str(exc)) from None
        doc["verification"] = _verify(rows, head, segment, server_key=server_key, pinned=pinned,
                                      address=server, balance=doc["balance"])
        doc["verification"].update(trust_on_first_use=pinned is None, known_servers=str(known.path))
        if doc["verification"]["ok"]:
            known.remember_head(server, entries=head.entries, last_hash=head.last_hash)
    return doc


def _failed(reason: str, *, checked: int = 0, first_bad_seq: int | None = None) -> dict:
    return {"ok": False, "checked": checked, "first_bad_seq": first_bad_seq, "reason": reason,
            "head_seq": None, "head_hash": None}


def _verify(rows: list[dict], head, segment: list[dict], *, server_key: bytes, pinned, address: str,
            balance: int) -> dict:
    """The contributor's entries, the signed head, and the chain from the remembered head up to it."""
    try:
        verify_ledger_head(head, server_key=server_key, address=address)
    except UntrustedServer as exc:
        return _failed(str(exc))
    seen = pinned.head_entries if pinned is not None and pinned.head_entries else 0
    if head.entries < seen:
        return _failed(f"the server now signs a ledger of {head.entries} entries, fewer than the {seen} this client "
                       f"verified before: entries were hidden or deleted, or this is another server with the same "
                       "key", first_bad_seq=head.entries + 1)
    start = max(0, seen - 1)
    seqs = [r["seq"] for r in segment]
    if seqs != list(range(start + 1, head.entries + 1)):
        return _failed(f"the ledger streamed does not match the signed head: expected entries {start + 1}.."
                       f"{head.entries}, got {len(seqs)} entries", first_bad_seq=start + 1)
    chain = verify_entries(segment, server_key)
    if not chain.ok:
        return asdict(chain)
    if seen and segment[0]["entry_hash"] != pinned.head_hash:
        return _failed(f"entry {seen} is now {segment[0]['entry_hash'][:16]}..., not the "
                       f"{pinned.head_hash[:16]}... this client verified before: the ledger's history was "
                       "rewritten", checked=chain.checked, first_bad_seq=seen)
    if segment and segment[-1]["entry_hash"] != head.last_hash:
        return _failed("the last entry streamed is not the one the signed head names", checked=chain.checked,
                       first_bad_seq=head.entries)
    by_seq = {r["seq"]: r["entry_hash"] for r in segment}
    withheld = [r["seq"] for r in rows if r.get("redacted")]
    if withheld:  # a redacted entry is checked on its signature only: its owner must get it whole
        return _failed(f"the server withheld the figures of your own entries (seq {withheld[0]}): only their owner "
                       "can recompute their hashes, so this client must get them whole", first_bad_seq=withheld[0])
    mine = verify_entries(rows, server_key)
    if not mine.ok:
        return asdict(mine)
    for r in rows:
        if r["seq"] in by_seq and by_seq[r["seq"]] != r["entry_hash"]:
            return _failed(f"your entry {r['seq']} differs from the same entry in the whole ledger",
                           checked=mine.checked, first_bad_seq=r["seq"])
    total = sum(r["amount"] for r in rows)
    if total != balance:
        return _failed(f"balance {balance} != sum of the signed entries {total}", checked=mine.checked)
    report = asdict(mine)
    report.update(head_seq=head.entries or None, head_hash=head.last_hash or None,
                  ledger_head={"entries": head.entries, "last_hash": head.last_hash,
                               "signed_at_unix": head.signed_at_unix})
    return report


def own_entries(stub, *, key, contributor_id: str, server_key: bytes, since_seq: int = 0) -> list[dict]:
    """This contributor's ledger entries after `since_seq`, asked with its own signature (a server with DP shows
    an owner its figures whole) and each checked against the pinned server key; RewardsError when one comes
    redacted or does not verify."""
    request = gym_pb2.LedgerRequest(since_seq=since_seq, **query_signature("StreamLedger", key, contributor_id))
    rows = [_row(e) for e in stub.StreamLedger(request, timeout=60)]
    withheld = [r["seq"] for r in rows if r["redacted"]]
    if withheld:
        raise RewardsError(f"the server withheld the figures of your own ledger entry {withheld[0]}")
    report = verify_entries(rows, server_key)
    if not report.ok:
        raise RewardsError(f"your ledger entry {report.first_bad_seq} does not verify against the server's pinned "
                           f"key ({report.reason}): run `gym-client rewards --verify`")
    return rows


def payout(round_id: int, entries: list[dict]) -> tuple[dict, str]:
    """(the round's JSON field, one line) for what `entries` (this contributor's of `round_id`) say it was paid
    and why: "round 2: paid 131 of 1000: score ..." or "round 3: not paid: <reason>"."""
    if not entries:
        reason = "no ledger entry for this round (a server without a validation set does not score or pay)"
        return {"paid": False, "amount": 0, "kind": None, "reason": reason, "seq": []}, \
            f"round {round_id}: not paid: {reason}"
    main = next((e for e in entries if e["kind"] in ("reward", "refusal")), entries[0])
    amount = sum(int(e["amount"]) for e in entries)
    field = {"paid": main["kind"] == "reward", "amount": amount, "kind": main["kind"], "score": main["score"],
             "reputation_after": main["reputation_after"], "reason": main["reason"],
             "seq": [e["seq"] for e in entries]}
    if main["kind"] == "reward":
        line = main["reason"] if main["reason"].startswith("paid ") else f"paid {main['amount']}: {main['reason']}"
    elif main["kind"] == "refusal":
        line = f"not paid: {main['reason']}"
    else:
        line = f"{main['kind']} {main['amount']}: {main['reason']}"
    if len(entries) > 1:
        line += f" ({len(entries)} entries this round, {amount} in all)"
    return field, f"round {round_id}: {line}"
