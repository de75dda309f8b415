"""What a contributor signs, byte for byte, and the Ed25519 helpers both sides use.

A contributor signs ``b"zoo-gym/v1\\n" + "\\n".join([method, contributor_id, str(round_id),
payload_sha256, nonce.hex(), base_sha256]).utf8``, each field validated first (no newlines, hex where hex
is expected), so a signature binds one request and is worthless in any other. The server signs each kind
of message under its own domain (``zoo-gym/round-info/v1``, ``zoo-gym/ledger-head/v1``,
``zoo-gym/lineage/v1``, each + ``\\n``) over canonical JSON: keys sorted, separators "," and ":", ASCII,
floats as `float.hex()` strings, bytes as lowercase hex (a lineage keeps its floats as JSON numbers).
RoundInfo leaves out you_submitted and signature, and a sync RoundInfo the async fields.
Fields and reasons: docs/design/signing.md.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

DOMAIN = b"zoo-gym/v1\n"
NONCE_BYTES = 16
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_ID = re.compile(r"^[0-9a-f]{32}$")
METHODS = ("Register", "SubmitDelta", "GetRound", "GetBalance", "StreamLedger")
QUERIES = ("GetRound", "GetBalance", "StreamLedger")  # read-only calls a contributor may sign to say who asks


class SignatureError(ValueError):
    """A signature or a signed field is malformed or does not verify."""


def contributor_id(public_key: bytes) -> str:
    """The contributor id: the first 32 hex characters of sha256(raw public key)."""
    if len(public_key) != 32:
        raise SignatureError(f"an Ed25519 public key has 32 bytes, got {len(public_key)}")
    return hashlib.sha256(public_key).hexdigest()[:32]


def canonical_bytes(
    *, method: str, contributor: str, round_id: int, payload_sha256: str, nonce: bytes, base_sha256: str = ""
) -> bytes:
    """The exact bytes a contributor signs for `method` (see the module docstring)."""
    if method not in METHODS:
        raise SignatureError(f"unknown signed method {method!r}; expected one of {METHODS}")
    if not _ID.match(contributor):
        raise SignatureError("contributor_id must be 32 lowercase hex characters (from Register)")
    if round_id < 0:
        raise SignatureError("round_id must be >= 0")
    if not _HEX64.match(payload_sha256):
        raise SignatureError("payload_sha256 must be 64 lowercase hex characters")
    if base_sha256 and not _HEX64.match(base_sha256):
        raise SignatureError("base_sha256 must be 64 lowercase hex characters")
    if len(nonce) != NONCE_BYTES:
        raise SignatureError(f"nonce must be {NONCE_BYTES} bytes, got {len(nonce)}")
    fields = [method, contributor, str(round_id), payload_sha256, nonce.hex(), base_sha256]
    return DOMAIN + "\n".join(fields).encode()


def query_bytes(method: str, *, contributor: str, signed_at_unix: int, nonce: bytes) -> bytes:
    """What a contributor signs to say who asks a read-only `method` (QUERIES): its canonical bytes, whose
    payload is sha256(str(signed_at_unix)) (the server accepts a small clock skew only)."""
    if method not in QUERIES:
        raise SignatureError(f"{method!r} is not a signed query; expected one of {QUERIES}")
    return canonical_bytes(method=method, contributor=contributor, round_id=0, nonce=nonce,
                           payload_sha256=hashlib.sha256(str(int(signed_at_unix)).encode()).hexdigest())


def get_round_bytes(*, contributor: str, signed_at_unix: int, nonce: bytes) -> bytes:
    """What a contributor signs to learn RoundInfo.you_submitted (`query_bytes` of GetRound)."""
    return query_bytes("GetRound", contributor=contributor, signed_at_unix=signed_at_unix, nonce=nonce)


ROUND_INFO_DOMAIN = b"zoo-gym/round-info/v1\n"
LEDGER_HEAD_DOMAIN = b"zoo-gym/ledger-head/v1\n"
LINEAGE_DOMAIN = b"zoo-gym/lineage/v1\n"
LINEAGE_SIGNATURE = "server_signature"  # the lineage manifest's key holding the server's signature (hex)


def _canonical_json(obj) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode()


def round_info_bytes(info) -> bytes:
    """The exact bytes the server signs for a RoundInfo (any object with its fields; docs/design/signing.md).

    you_submitted (it differs per asker) and signature are left out; everything else is covered. Fields added
    later (async, sampling, per-round epsilon, DP participation, mirrors, lr scale) are covered only when set, so older
    answers keep their bytes."""
    lim = info.limits
    obj = {
        "round_id": int(info.round_id), "state": int(info.state), "base_checkpoint_id": int(info.base_checkpoint_id),
        "base_sha256": str(info.base_sha256), "base_size": int(info.base_size),
        "deadline_unix": float(info.deadline_unix).hex(), "accepted_codecs": [str(c) for c in info.accepted_codecs],
        "limits": {"max_payload_bytes": int(lim.max_payload_bytes), "max_chunk_bytes": int(lim.max_chunk_bytes),
                   "download_chunk_bytes": int(lim.download_chunk_bytes),
                   "max_delta_norm": float(lim.max_delta_norm).hex()},
        "submissions": int(info.submissions), "min_contributors": int(info.min_contributors),
        "message": str(info.message), "aggregator": str(info.aggregator),
        "dp_epsilon_spent": float(info.dp_epsilon_spent).hex(), "dp_delta": float(info.dp_delta).hex(),
        "server_public_key": bytes(info.server_public_key).hex(),
    }
    mode = str(getattr(info, "mode", "") or "")
    if mode not in ("", "sync"):  # a synchronous RoundInfo's bytes leave these fields out
        obj.update({"mode": mode, "buffer_size": int(info.buffer_size), "max_staleness": int(info.max_staleness),
                    "staleness_exponent": float(info.staleness_exponent).hex(),
                    "server_lr": float(info.server_lr).hex()})
    elif float(getattr(info, "server_lr", 0.0) or 0.0) not in (0.0, 1.0):  # sync with --server-lr other than 1
        obj["server_lr"] = float(info.server_lr).hex()
    q = float(getattr(info, "sample_rate", 0.0) or 0.0)
    if q not in (0.0, 1.0):  # sampling: who is selected (per asker, so signed per answer) and how many
        obj.update({"sample_rate": q.hex(), "selected_count": int(info.selected_count),
                    "selected": bool(info.selected)})
    for name in ("dp_epsilon_round", "dp_epsilon_spent_rdp"):  # left out when 0, as before they existed
        if float(getattr(info, name, 0.0) or 0.0):
            obj[name] = float(getattr(info, name)).hex()
    participation = str(getattr(info, "dp_participation", "") or "")
    if participation:  # with server DP on only ("public" or "private"); without DP the bytes are as before
        obj["dp_participation"] = participation
    lr_scale = float(getattr(info, "client_lr_scale", 0.0) or 0.0)
    if lr_scale not in (0.0, 1.0):  # --client-lr-decay: the round's factor on every contributor's learning rate
        obj["client_lr_scale"] = lr_scale.hex()
    mirrors = [str(m) for m in getattr(info, "mirrors", ())]
    if mirrors:  # --mirror: where the checkpoint's bytes may also be fetched, in order; none: bytes as before
        obj["mirrors"] = mirrors
    return ROUND_INFO_DOMAIN + _canonical_json(obj)


def ledger_head_bytes(*, entries: int, last_hash: str, signed_at_unix: int) -> bytes:
    """The exact bytes the server signs for its ledger head (entry count, last entry_hash, when)."""
    if entries < 0 or signed_at_unix < 0:
        raise SignatureError("a ledger head's entries and signed_at_unix must be >= 0")
    if last_hash and not _HEX64.match(last_hash):
        raise SignatureError("a ledger head's last_hash must be 64 lowercase hex characters or empty")
    if bool(entries) != bool(last_hash):
        raise SignatureError("a ledger head has a last_hash exactly when it has entries")
    return LEDGER_HEAD_DOMAIN + _canonical_json(
        {"entries": int(entries), "last_hash": last_hash, "signed_at_unix": int(signed_at_unix)})


def lineage_bytes(lineage: dict) -> bytes:
    """The exact bytes the server signs for a lineage manifest (the manifest without its signature).

    Floats stay JSON numbers, which Python writes in their shortest exact form and reads back to the same
    value (NaN and Infinity as Python's json spells them), so the manifest read back from its file gives
    these bytes again."""
    body = {k: v for k, v in lineage.items() if k != LINEAGE_SIGNATURE}
    return LINEAGE_DOMAIN + json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


def sign(private_key: Ed25519PrivateKey, message: bytes) -> bytes:
    return private_key.sign(message)


def verify(public_key: bytes, signature: bytes, message: bytes) -> None:
    """Raise SignatureError unless `signature` is `public_key`'s Ed25519 signature of `message`."""
    try:
        Ed25519PublicKey.from_public_bytes(public_key).verify(signature, message)
    except (InvalidSignature, ValueError) as exc:
        raise SignatureError("the Ed25519 signature does not verify for this contributor's key") from exc


def public_bytes(private_key: Ed25519PrivateKey) -> bytes:
    return private_key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def load_or_create_key(path: Path) -> tuple[Ed25519PrivateKey, bool]:
    """Load a PEM (PKCS#8, unencrypted) Ed25519 key, or create one with mode 0600. Returns (key, created)."""
    path = Path(path)
    if path.exists():
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (ValueError, TypeError) as exc:
            raise SignatureError(f"{path} is not an unencrypted PEM private key: {exc}") from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise SignatureError(f"{path} holds a {type(key).__name__}, not an Ed25519 key")
        return key, False
    key = Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
        f.flush()
        os.fsync(f.fileno())
    return key, True
