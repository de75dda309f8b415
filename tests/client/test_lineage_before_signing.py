"""Checkpoints published before lineages were signed (issue 47): what today's client accepts, and what it refuses.

The first release (f956b6f) and 0.1.0 published lineage manifests without `server_signature`. Such a manifest
is accepted only as part of the archive a RoundInfo signed by the pinned server key names: the unpacked
directory must pack back to exactly that sha256. Everything else stays refused: no signed round state, one
signed by another key, one naming another checkpoint, a manifest edited after download, a forged signature.
The checkpoints are the frozen fixtures' own round-1 archives, written by each release's code.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from zoo_gym.client.download import DownloadError, fetch_checkpoint
from zoo_gym.client.known_servers import UntrustedServer
from zoo_gym.client.server_signatures import verify_lineage
from zoo_gym.proto import archive, gym_pb2, signing
from zoo_gym.server.rounds.signed_state import sign_lineage, sign_round_info

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures"
RELEASES = {"f956b6f": "lineage from before signing (the first release, f956b6f)",
            "v0.1.0": "lineage from before signing (release 0.1.0)"}


def _round_1_archive(release: str) -> Path:
    sha = json.loads((FIXTURES / f"state-{release}" / "made_by.json").read_text())["round_1_checkpoint"]
    return FIXTURES / f"state-{release}" / "blobs" / "sha256" / sha[:2] / sha


def _round_info(key: Ed25519PrivateKey, sha256: str, size: int = 1) -> gym_pb2.RoundInfo:
    info = gym_pb2.RoundInfo(round_id=2, state=gym_pb2.ROUND_STATE_OPEN, base_checkpoint_id=1, base_sha256=sha256,
                             base_size=size, server_public_key=signing.public_bytes(key))
    return sign_round_info(info, key=key)


@pytest.fixture
def server_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


@pytest.mark.parametrize("release", sorted(RELEASES))
def test_named_by_the_signed_round_state_it_is_accepted_and_said(tmp_path, server_key, release):
    blob = _round_1_archive(release)
    model_dir = archive.unpack(blob, tmp_path / blob.name)
    lineage = json.loads((model_dir / archive.LINEAGE).read_text())
    assert signing.LINEAGE_SIGNATURE not in lineage and lineage["round"] == 1  # as the release wrote it
    checked = verify_lineage(model_dir, server_key=signing.public_bytes(server_key),
                             round_info=_round_info(server_key, blob.name))
    assert checked.lineage == lineage
    assert checked.note == (f"base checkpoint {blob.name[:12]} (round 1): {RELEASES[release]}, accepted because "
                            "the server-signed round state names its sha256 and the checkpoint hashes to it")


def test_not_named_by_a_signed_round_state_it_is_refused(tmp_path, server_key):
    blob = _round_1_archive("f956b6f")
    model_dir = archive.unpack(blob, tmp_path / blob.name)
    pub = signing.public_bytes(server_key)
    with pytest.raises(UntrustedServer, match="is unsigned and no server-signed round state names the checkpoint"):
        verify_lineage(model_dir, server_key=pub)
    other = _round_1_archive("v0.1.0").name  # a signed round state naming another checkpoint
    with pytest.raises(UntrustedServer, match=f"is not the {other[:12]} the server-signed round state names"):
        verify_lineage(model_dir, server_key=pub, round_info=_round_info(server_key, other))
    impostor = Ed25519PrivateKey.generate()  # the right sha256, signed by a key this client did not pin
    with pytest.raises(UntrustedServer, match="the round state naming it is not signed by the pinned server key"):
        verify_lineage(model_dir, server_key=pub, round_info=_round_info(impostor, blob.name))
    forged = _round_info(server_key, blob.name)
    forged.base_checkpoint_id = 7  # altered after signing
    with pytest.raises(UntrustedServer, match="the round state naming it is not signed by the pinned server key"):
        verify_lineage(model_dir, server_key=pub, round_info=forged)


def test_an_edited_or_forged_manifest_is_refused_though_the_round_state_names_the_checkpoint(tmp_path, server_key):
    blob = _round_1_archive("f956b6f")
    pub, info = signing.public_bytes(server_key), _round_info(server_key, blob.name)
    model_dir = archive.unpack(blob, tmp_path / blob.name)
    lineage = json.loads((model_dir / archive.LINEAGE).read_text())
    archive.write_lineage(model_dir, {**lineage, "aggregator": "krum"})  # edited, still unsigned
    with pytest.raises(UntrustedServer, match="round state names: refusing the checkpoint"):
        verify_lineage(model_dir, server_key=pub, round_info=info)
    forged = {**lineage, signing.LINEAGE_SIGNATURE: "00" * 64}  # a signature that is not the server's
    archive.write_lineage(model_dir, forged)
    with pytest.raises(UntrustedServer, match="not signed by the pinned server key"):
        verify_lineage(model_dir, server_key=pub, round_info=info)
    other = Ed25519PrivateKey.generate()  # signed, but by another key: named or not, refused
    archive.write_lineage(model_dir, sign_lineage(lineage, key=other))
    with pytest.raises(UntrustedServer, match="not signed by the pinned server key"):
        verify_lineage(model_dir, server_key=pub, round_info=info)
    archive.write_lineage(model_dir, sign_lineage(lineage, key=server_key))  # today's way: signed, no note
    assert verify_lineage(model_dir, server_key=pub).note is None


class _Stub:
    """Serves one archive's bytes as DownloadCheckpoint does."""

    def __init__(self, blob: Path) -> None:
        self.data, self.calls = blob.read_bytes(), 0

    def DownloadCheckpoint(self, request, **_kw):  # noqa: N802 - gRPC naming
        self.calls += 1
        for offset in range(request.offset, len(self.data), 1 << 16):
            yield gym_pb2.CheckpointChunk(offset=offset, data=self.data[offset:offset + (1 << 16)])


def test_the_download_says_what_it_accepted_and_discards_what_it_refuses(tmp_path, server_key):
    blob = _round_1_archive("f956b6f")
    stub, pub, size = _Stub(blob), signing.public_bytes(server_key), blob.stat().st_size
    said: list[str] = []
    with pytest.raises(DownloadError, match="is unsigned and no server-signed round state names"):
        fetch_checkpoint(stub, blob.name, size, tmp_path, progress=False, server_key=pub, say=said.append)
    assert not (tmp_path / "checkpoints" / blob.name).exists() and said == []  # discarded, nothing said

    info = _round_info(server_key, blob.name, size)
    model_dir = fetch_checkpoint(stub, blob.name, size, tmp_path, progress=False, server_key=pub, round_info=info,
                                 say=said.append)
    assert (model_dir / archive.WEIGHTS).is_file() and len(said) == 1
    assert "lineage from before signing (the first release, f956b6f)" in said[0]
    calls = stub.calls
    fetch_checkpoint(stub, blob.name, size, tmp_path, progress=False, server_key=pub, round_info=info,
                     say=said.append)  # from the cache: checked again, not downloaded again
    assert stub.calls == calls and len(said) == 2

    (model_dir / archive.LINEAGE).write_text((model_dir / archive.LINEAGE).read_text().replace("mean", "krum"))
    with pytest.raises(DownloadError, match="round state names: refusing the checkpoint; it was discarded"):
        fetch_checkpoint(stub, blob.name, size, tmp_path, progress=False, server_key=pub, round_info=info)
    assert not model_dir.exists()
