"""Verifying ledger entries: the whole chain (server, auditor) or one contributor's entries (client).

`verify_chain` checks, in seq order, that ``seq`` counts up from 1, ``prev_hash`` links to the previous
entry (``GENESIS_HASH`` for seq 1), ``entry_hash`` is sha256 of `canonical_entry_bytes`, and
``signature`` is the server's Ed25519 signature of `signing_message(entry_hash)`; it stops at the first
bad entry and names its seq. ``expected_head=(seq, hash)`` also catches the deletion of the newest.
`verify_entries` checks a client's own entries: hash, signature, increasing seqs, and the link where two
are adjacent; it cannot see a deletion among other contributors' entries. A ``redacted`` entry (another
contributor's, streamed by a server with DP on: its figures withheld) is checked on what it keeps: its place
in the chain and the server's signature over its entry_hash; only its owner can recompute that hash.
Details: docs/design/rewards-settlement.md.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from .errors import LedgerError
from .entry_hash import GENESIS_HASH, compute_entry_hash, entry_field, signing_message


@dataclass(frozen=True)
class VerifyReport:
    """Outcome of a verification; ``first_bad_seq`` and ``reason`` are None when ``ok``."""

    ok: bool
    checked: int                    # entries that passed every check
    first_bad_seq: int | None = None
    reason: str | None = None
    head_seq: int | None = None     # last good entry (seq, hash): keep it for `expected_head`
    head_hash: str | None = None


def load_public_key(key: Ed25519PublicKey | bytes | str) -> Ed25519PublicKey:
    """An Ed25519 public key from the object, 32 raw bytes or their hex."""
    if isinstance(key, Ed25519PublicKey):
        return key
    raw = bytes.fromhex(key) if isinstance(key, str) else bytes(key)
    if len(raw) != 32:
        raise LedgerError(f"an Ed25519 public key is 32 bytes (64 hex digits), got {len(raw)} bytes")
    return Ed25519PublicKey.from_public_bytes(raw)


def _redacted(entry: Any) -> bool:
    return bool(entry.get("redacted", False) if isinstance(entry, dict) else getattr(entry, "redacted", False))


def _check_entry(entry: Any, key: Ed25519PublicKey) -> str | None:
    """Problem with the entry's own hash or signature, or None (a redacted entry: its signature only)."""
    stored = str(entry_field(entry, "entry_hash"))
    try:
        recomputed = stored if _redacted(entry) else compute_entry_hash(entry)
    except (LedgerError, ValueError, TypeError, KeyError, AttributeError) as exc:
        return f"entry cannot be encoded: {exc}"
    if recomputed != stored:
        return (f"entry_hash mismatch: the fields hash to {recomputed[:16]}..., the entry says "
                f"{stored[:16]}... (a field was edited)")
    try:
        key.verify(bytes.fromhex(str(entry_field(entry, "signature"))), signing_message(stored))
    except (InvalidSignature, ValueError):
        return "bad signature: not signed by the server key over this entry_hash"
    return None


def verify_chain(entries: Iterable[Any], public_key: Ed25519PublicKey | bytes | str, *,
                 expected_head: tuple[int, str] | None = None,
                 start: tuple[int, str] | None = None) -> VerifyReport:
    """Check the whole chain from seq 1 (see the module docstring); stops at the first bad entry.

    ``first_bad_seq`` is the first seq that is missing or fails a check. ``start=(seq, hash)``: the entries
    continue a chain already verified up to that entry (they begin at seq + 1 and link to its hash).
    """
    key = load_public_key(public_key)
    prev_seq, prev_hash = start if start is not None else (0, GENESIS_HASH)
    checked = 0
    seen_head_hash: str | None = None

    def report(bad_seq: int, reason: str) -> VerifyReport:
        return VerifyReport(ok=False, checked=checked, first_bad_seq=bad_seq, reason=reason,
                            head_seq=prev_seq or None, head_hash=prev_hash if prev_seq else None)

    for entry in entries:
        try:
            seq = int(entry_field(entry, "seq"))
        except (ValueError, TypeError, KeyError, AttributeError):
            return report(prev_seq + 1, "entry without a readable seq")
        if seq != prev_seq + 1:
            return report(prev_seq + 1, f"seq gap or reorder: expected seq {prev_seq + 1}, found "
                                        f"{seq} (an entry was deleted or entries were swapped)")
        if str(entry_field(entry, "prev_hash")) != prev_hash:
            return report(seq, f"prev_hash does not link to entry {prev_seq}'s hash "
                               "(an entry was deleted, replaced or swapped)")
        bad = _check_entry(entry, key)
        if bad is not None:
            return report(seq, bad)
        prev_seq, prev_hash, checked = seq, str(entry_field(entry, "entry_hash")), checked + 1
        if expected_head is not None and seq == expected_head[0]:
            seen_head_hash = prev_hash
    if expected_head is not None:
        head_seq, head_hash = expected_head
        if prev_seq < head_seq:
            return report(prev_seq + 1, f"chain ends at seq {prev_seq} but the expected head is "
                                        f"seq {head_seq} (the newest entries were deleted)")
        if head_seq > 0 and seen_head_hash != head_hash:
            return report(head_seq, f"entry {head_seq} is not the expected head {head_hash[:16]}... "
                                    "(the history was rewritten)")
    return VerifyReport(ok=True, checked=checked, head_seq=prev_seq or None,
                        head_hash=prev_hash if prev_seq else None)


def verify_entries(entries: Iterable[Any], public_key: Ed25519PublicKey | bytes | str
                   ) -> VerifyReport:
    """Check a subset of the ledger (one contributor's entries): hash, signature, order and the
    links between adjacent seqs. It cannot check links through others' entries."""
    key = load_public_key(public_key)
    prev_seq, prev_hash, checked = 0, None, 0
    for entry in entries:
        seq = int(entry_field(entry, "seq"))
        bad = None
        if seq <= prev_seq:
            bad = f"seq {seq} does not increase after {prev_seq} (entries reordered or repeated)"
        elif seq == prev_seq + 1 and prev_hash is not None \
                and str(entry_field(entry, "prev_hash")) != prev_hash:
            bad = f"prev_hash does not link to entry {prev_seq}'s hash"
        elif seq == 1 and str(entry_field(entry, "prev_hash")) != GENESIS_HASH:
            bad = "entry 1 must link to the genesis hash"
        else:
            bad = _check_entry(entry, key)
        if bad is not None:
            return VerifyReport(ok=False, checked=checked, first_bad_seq=seq, reason=bad)
        prev_seq, prev_hash, checked = seq, str(entry_field(entry, "entry_hash")), checked + 1
    return VerifyReport(ok=True, checked=checked, head_seq=prev_seq or None, head_hash=prev_hash)
