"""Checking what the server signed (round state, ledger head, checkpoint lineage) against its pinned key.

The byte layouts are in zoo_gym/proto/signing.py; the server side is zoo_gym/server/rounds/signed_state.py.
Each check raises UntrustedServer with one line that says what was refused and why.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
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


# Checkpoints published before lineages were signed (issue 47). The first release (f956b6f) and 0.1.0 wrote
# lineage manifests without `server_signature`; a federation upgraded with `gym-server migrate` serves its next
# round on such a checkpoint. Design (docs/design/signing.md, "Checkpoints from before lineage signing"): the
# unsigned manifest is accepted on the strength of what today's server does sign, the round state. A
# RoundInfo signed by the pinned key names the base's sha256, and the unpacked directory, manifest included,
# must pack back to exactly that sha256; nothing else makes an unsigned manifest acceptable (a checkpoint no
# signed round state names, or a directory edited after download, is refused), and a manifest that does carry
# a signature must verify. Nothing is re-signed at upgrade: a signature made then would vouch for a lineage the
# server never checked at publish, and the new manifest bytes would change the checkpoint's sha256, which
# the ledger, the contributors' deltas and their caches all name.

# The fields each release that wrote unsigned manifests used: they name the release in what the contributor
# is told, and decide nothing about whether the manifest is accepted.
_F956B6F_FIELDS = frozenset({"round", "parent_sha256", "contributors", "accepted", "aggregator", "privacy"})
_V0_1_0_FIELDS = _F956B6F_FIELDS | {"base_model", "submissions", "history"}
_V0_1_0_OPTIONAL = frozenset({"master_sha256", "master_dtype"})  # with float32 masters only


@dataclass(frozen=True)
class CheckedLineage:
    """A checkpoint's lineage manifest and, when it carries no server signature of its own, `note`: the one
    line that says what it was accepted on (said to the contributor)."""

    lineage: dict
    note: str | None = None


def unsigned_release(lineage: dict) -> str | None:
    """The release whose fields an unsigned lineage manifest has, or None when it matches none."""
    keys = set(lineage)
    if keys == _F956B6F_FIELDS:
        return "the first release, f956b6f"
    if keys - _V0_1_0_OPTIONAL == _V0_1_0_FIELDS:
        return "release 0.1.0"
    return None


def verify_lineage(model_dir: Path, *, server_key: bytes, round_info=None) -> CheckedLineage:
    """The checkpoint's lineage manifest, once its `server_signature` verifies with `server_key`.

    The genesis checkpoint (round 0, written by `gym-server init`) carries no signature; it is trusted
    through the signed sha256 of the round that names it. A manifest published before lineages were signed
    (the first release and 0.1.0) is accepted only with `round_info`, a RoundInfo `server_key` signed whose
    base_sha256 the directory packs to exactly (`note` says so). Every other published checkpoint must be
    signed."""
    path = Path(model_dir) / archive.LINEAGE
    try:
        lineage = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UntrustedServer(f"the checkpoint's lineage manifest {path} cannot be read: {exc}") from None
    if not isinstance(lineage, dict):
        raise UntrustedServer(f"the checkpoint's lineage manifest {path} is not a JSON object")
    signature = lineage.get(signing.LINEAGE_SIGNATURE)
    if signature is None and lineage.get("round") == 0:
        return CheckedLineage(lineage)
    if signature is None:
        return _named_by_signed_round(Path(model_dir), lineage, server_key=server_key, round_info=round_info)
    try:
        raw = bytes.fromhex(signature) if isinstance(signature, str) else b""
    except ValueError:
        raw = b""
    if not _verifies(server_key, raw, signing.lineage_bytes(lineage)):
        raise UntrustedServer(f"the lineage manifest of checkpoint round {lineage.get('round')} is "
                              "not signed by the pinned server key: refusing the checkpoint")
    return CheckedLineage(lineage)


def _named_by_signed_round(model_dir: Path, lineage: dict, *, server_key: bytes, round_info) -> CheckedLineage:
    """An unsigned manifest, accepted only as part of the archive a server-signed round state names."""
    unsigned = f"the lineage manifest of checkpoint round {lineage.get('round')} is unsigned"
    if round_info is None:
        raise UntrustedServer(f"{unsigned} and no server-signed round state names the checkpoint: refusing it")
    if (bytes(round_info.server_public_key) != server_key
            or not _verifies(server_key, bytes(round_info.signature), signing.round_info_bytes(round_info))):
        raise UntrustedServer(f"{unsigned} and the round state naming it is not signed by the pinned server key: "
                              "refusing the checkpoint")
    named = str(round_info.base_sha256)
    try:
        packed = archive.packed_sha256(model_dir)
    except (archive.CheckpointError, OSError) as exc:
        raise UntrustedServer(f"{unsigned} and its directory cannot be checked against the signed round "
                              f"state: {exc}; refusing the checkpoint") from None
    if packed != named:
        raise UntrustedServer(f"{unsigned} and the checkpoint ({packed[:12]}) is not the {named[:12]} the "
                              "server-signed round state names: refusing the checkpoint")
    release = unsigned_release(lineage)
    origin = (f"lineage from before signing ({release})" if release is not None else
              "lineage without a server signature (its fields match no release from before signing)")
    return CheckedLineage(lineage, f"base checkpoint {named[:12]} (round {lineage.get('round')}): {origin}, "
                                   "accepted because the server-signed round state names its sha256 and the "
                                   "checkpoint hashes to it")
