"""Checking what the server signed (round state, ledger head, checkpoint lineage) against its pinned key.

The byte layouts are in zoo_gym/proto/signing.py; the server side is zoo_gym/server/rounds/signed_state.py.
Each check raises UntrustedServer with one line that says what was refused and why.
"""

from __future__ import annotations

import json
from pathlib import Path

from zoo_gym.client.known_servers import UntrustedServer
from zoo_gym.proto import archive, signing


def _verifies(server_key: bytes, signature: bytes, message: bytes) -> bool:
    try:
        signing.verify(server_key, signature, message)
    except signing.SignatureError:
        return False
    return True


def verify_round_info(info, *, server_key: bytes, address: str) -> None:
    """Refuse a RoundInfo unless the pinned `server_key` signed it (everything but you_submitted)."""
    if bytes(info.server_public_key) != server_key:
        raise UntrustedServer(f"the round state from {address} names server key "
                              f"{bytes(info.server_public_key).hex()[:16]}..., not the pinned "
                              f"{server_key.hex()[:16]}...: refusing to download or train")
    if not _verifies(server_key, bytes(info.signature), signing.round_info_bytes(info)):
        raise UntrustedServer(f"the round state from {address} (round {info.round_id}, base "
                              f"{info.base_sha256[:12]}) is not signed by the server's pinned key: it was altered "
                              "on the way (a man in the middle?) or forged; refusing to download or train")


def verify_ledger_head(head, *, server_key: bytes, address: str) -> None:
    """Refuse a LedgerHead unless the pinned `server_key` signed its entry count and last hash."""
    try:
        message = signing.ledger_head_bytes(entries=head.entries, last_hash=head.last_hash,
                                            signed_at_unix=head.signed_at_unix)
    except signing.SignatureError as exc:
        raise UntrustedServer(f"the ledger head from {address} is malformed: {exc}") from None
    if not _verifies(server_key, bytes(head.signature), message):
        raise UntrustedServer(f"the ledger head from {address} ({head.entries} entries) is not signed by the "
                              "server's pinned key: refusing it")


def verify_lineage(model_dir: Path, *, server_key: bytes) -> dict:
    """The checkpoint's lineage manifest, once its `server_signature` verifies with `server_key`.

    The genesis checkpoint (round 0, written by `gym-server init`) carries no signature; it is trusted
    through the signed sha256 of the round that names it. Every published checkpoint must be signed."""
    path = Path(model_dir) / archive.LINEAGE
    try:
        lineage = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UntrustedServer(f"the checkpoint's lineage manifest {path} cannot be read: {exc}") from None
    if not isinstance(lineage, dict):
        raise UntrustedServer(f"the checkpoint's lineage manifest {path} is not a JSON object")
    signature = lineage.get(signing.LINEAGE_SIGNATURE)
    if signature is None and lineage.get("round") == 0:
        return lineage
    try:
        raw = bytes.fromhex(signature) if isinstance(signature, str) else b""
    except ValueError:
        raw = b""
    if not _verifies(server_key, raw, signing.lineage_bytes(lineage)):
        raise UntrustedServer(f"the lineage manifest of checkpoint round {lineage.get('round')} is "
                              f"{'unsigned' if signature is None else 'not signed by the pinned server key'}: "
                              "refusing the checkpoint")
    return lineage
