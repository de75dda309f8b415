"""`gym-client rewards`: balance, reputation and ledger entries, verified against the server's key.

The server's public key is pinned on first contact (trust on first use): `join` writes it next to the
contributor key as `<key>.server.pub`; later verification uses the pinned key, so a server that swapped
its key (or a man in the middle) is detected rather than trusted.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import grpc

from zoo_gym.client.connection import TransportMismatch, open_stub, transport_mismatch
from zoo_gym.proto import gym_pb2, signing
from zoo_gym.rewards import verify_entries


class RewardsError(RuntimeError):
    """Cannot answer the rewards query; the message says why."""


def pinned_key_path(key_path: Path) -> Path:
    return Path(str(key_path) + ".server.pub")


def pin_server_key(key_path: Path, server_key: bytes) -> None:
    """Remember the server's key on first contact; refuse a different one later."""
    path = pinned_key_path(key_path)
    if path.exists():
        if path.read_text().strip() != server_key.hex():
            raise RewardsError(f"the server's public key differs from the one pinned in {path}: refusing to "
                               "trust it (delete that file only if the operator announced a new key)")
        return
    path.write_text(server_key.hex() + "\n")


def fetch_rewards(server: str, *, key_path: Path, contributor: str | None, limit: int, verify: bool,
                  root_certificates: str | None = None, insecure: bool = False) -> dict:
    if contributor is None:
        if not Path(key_path).exists():
            raise RewardsError(f"no key at {key_path}: pass --contributor ID or --key PATH")
        key, _ = signing.load_or_create_key(key_path)
        contributor = signing.contributor_id(signing.public_bytes(key))
    channel, stub = open_stub(server, root_certificates=root_certificates, insecure=insecure)
    try:
        info = stub.GetRound(gym_pb2.GetRoundRequest(), timeout=30)
        balance = stub.GetBalance(gym_pb2.BalanceRequest(contributor_id=contributor), timeout=30)
        entries = [e for e in stub.StreamLedger(gym_pb2.LedgerRequest(contributor_id=contributor), timeout=60)]
    except grpc.RpcError as exc:
        problem = transport_mismatch(exc)
        if problem:
            raise TransportMismatch(f"cannot connect securely: {problem}") from exc
        raise
    finally:
        channel.close()
    rows = [{"seq": e.seq, "round_id": e.round_id, "contributor": e.contributor_id, "kind": e.kind,
             "amount": e.amount, "score": e.score, "reputation_after": e.reputation_after, "reason": e.reason,
             "prev_hash": e.prev_hash, "entry_hash": e.entry_hash, "signature": e.signature} for e in entries]
    doc = {"contributor_id": contributor, "balance": balance.balance, "reputation": balance.reputation,
           "entries": balance.entries, "sum_of_entries": sum(r["amount"] for r in rows),
           "recent": [{**r, "contributor_id": r.pop("contributor")} for r in [dict(x) for x in rows[-limit:]]]}
    if verify:
        server_key = info.server_public_key
        pinned = pinned_key_path(Path(key_path))
        if pinned.exists():
            server_key = bytes.fromhex(pinned.read_text().strip())
        report = verify_entries(rows, server_key)
        doc["verification"] = asdict(report)
        if report.ok and doc["sum_of_entries"] != doc["balance"]:
            doc["verification"] = {"ok": False, "first_bad_seq": None, "checked": report.checked,
                                   "reason": f"balance {doc['balance']} != sum of the signed entries "
                                             f"{doc['sum_of_entries']}"}
    return doc
