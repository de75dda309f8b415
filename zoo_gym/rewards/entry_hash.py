"""The bytes a ledger entry is hashed and signed over: what a client re-implements to verify.

``canonical_entry_bytes`` is UTF-8 JSON with keys sorted, separators ``","`` and ``":"``,
``ensure_ascii=True``; ints as JSON integers, floats in Python's shortest round-trip ``repr`` (``1e-07``),
strings JSON-escaped; non-finite floats are refused. The object: {"amount": int, "contributor": str, "kind": str, "prev_hash": str,
"reason": str, "reputation_after": float, "round_id": int, "score": float, "seq": int, "v": 1}.
``signing_message(h) = b"zoo-gym/ledger/v1\\n" + bytes.fromhex(h)`` (domain separation).
``GENESIS_HASH`` is the ``prev_hash`` of entry 1.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

from .errors import LedgerError

GENESIS_HASH = "0" * 64
SIGNING_CONTEXT = b"zoo-gym/ledger/v1\n"
CANONICAL_VERSION = 1
HASHED_FIELDS = ("seq", "round_id", "contributor", "kind", "amount", "score",
                 "reputation_after", "reason", "prev_hash")


def entry_field(entry: Any, name: str) -> Any:
    """``entry[name]`` for a mapping, else ``entry.name`` (an ORM row, a protobuf message)."""
    return entry[name] if isinstance(entry, Mapping) else getattr(entry, name)


def canonical_entry_bytes(entry: Any) -> bytes:
    """The exact bytes hashed into ``entry_hash`` (encoding in the module docstring).

    ``entry`` is a mapping or any object with the ``HASHED_FIELDS`` as attributes (a
    `LedgerEntryPublic`, a protobuf message, a dict from JSON).
    """
    obj: dict[str, Any] = {"v": CANONICAL_VERSION}
    for name in ("seq", "round_id", "amount"):
        obj[name] = int(entry_field(entry, name))
    for name in ("score", "reputation_after"):
        v = float(entry_field(entry, name))
        if not math.isfinite(v):
            raise LedgerError(f"`{name}` must be finite to be hashed, got {v!r}")
        obj[name] = v
    for name in ("contributor", "kind", "reason", "prev_hash"):
        obj[name] = str(entry_field(entry, name))
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True,
                      allow_nan=False).encode("utf-8")


def compute_entry_hash(entry: Any) -> str:
    """sha256 hex of `canonical_entry_bytes`."""
    return hashlib.sha256(canonical_entry_bytes(entry)).hexdigest()


def signing_message(entry_hash: str) -> bytes:
    """The bytes the server signs for an entry."""
    return SIGNING_CONTEXT + bytes.fromhex(entry_hash)
