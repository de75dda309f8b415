"""What the server signs with its Ed25519 key besides ledger entries: round state, the ledger head and
each published checkpoint's lineage manifest (byte layouts in zoo_gym/proto/signing.py).

A client checks these against the server key it pinned on first contact (zoo_gym/client/known_servers.py),
so a man in the middle cannot swap the base a contributor trains on, and a server (or impostor) cannot
later answer with a shorter or different ledger than one the client already verified.
"""

from __future__ import annotations

import time

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from sqlmodel import select

from zoo_gym.proto import gym_pb2, signing


def sign_round_info(info: gym_pb2.RoundInfo, *, key: Ed25519PrivateKey) -> gym_pb2.RoundInfo:
    """`info` with its `signature` set over signing.round_info_bytes(info) (you_submitted is not covered)."""
    info.signature = key.sign(signing.round_info_bytes(info))
    return info


def sign_lineage(lineage: dict, *, key: Ed25519PrivateKey) -> dict:
    """A copy of a lineage manifest carrying `server_signature` (hex) over signing.lineage_bytes of the rest.

    Ed25519 signatures are deterministic (RFC 8032), so the same inputs still publish the same bytes."""
    return {**lineage, signing.LINEAGE_SIGNATURE: key.sign(signing.lineage_bytes(lineage)).hex()}


def ledger_head(state, *, now: float | None = None) -> gym_pb2.LedgerHead:
    """The signed head of the ledger: entry count (the last seq; seqs are dense from 1) and last entry_hash."""
    from zoo_gym.rewards.ledger import LedgerEntry

    with state.session() as s:
        last = s.exec(select(LedgerEntry).order_by(LedgerEntry.seq.desc()).limit(1)).first()  # type: ignore[attr-defined]
    entries, last_hash = (int(last.seq), str(last.entry_hash)) if last is not None else (0, "")
    signed_at = int(time.time() if now is None else now)
    signature = state.key.sign(signing.ledger_head_bytes(entries=entries, last_hash=last_hash,
                                                         signed_at_unix=signed_at))
    return gym_pb2.LedgerHead(entries=entries, last_hash=last_hash, signed_at_unix=signed_at, signature=signature)
