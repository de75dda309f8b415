"""Sign and stream one delta to the server."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from tqdm import tqdm

from zoo_gym import codec
from zoo_gym.proto import gym_pb2, signing


def build_header(*, key: Ed25519PrivateKey, contributor_id: str, round_id: int, base_sha256: str,
                 payload: bytes, metadata: dict, nonce: bytes | None = None) -> gym_pb2.SubmitHeader:
    """The signed SubmitHeader for `payload` (see zoo_gym/proto/signing.py for what is signed)."""
    nonce = nonce or signing.new_nonce()
    payload_sha = codec.sha256_hex(payload)
    message = signing.canonical_bytes(method="SubmitDelta", contributor=contributor_id, round_id=round_id,
                                      payload_sha256=payload_sha, nonce=nonce, base_sha256=base_sha256)
    manifest = codec.read_manifest(payload)
    return gym_pb2.SubmitHeader(
        contributor_id=contributor_id, round_id=round_id, base_sha256=base_sha256, payload_sha256=payload_sha,
        payload_size=len(payload), nonce=nonce, signature=signing.sign(key, message),
        metadata_json=json.dumps(metadata, sort_keys=True, default=str),
        manifest=[gym_pb2.TensorSpec(name=e.name, shape=list(e.shape), dtype=e.dtype, codec=e.codec,
                                     nbytes=e.nbytes) for e in manifest.entries])


def request_stream(header: gym_pb2.SubmitHeader, payload: bytes, *, chunk_bytes: int,
                   progress: bool = False) -> Iterator[gym_pb2.SubmitRequest]:
    yield gym_pb2.SubmitRequest(header=header)
    view = memoryview(payload)
    with tqdm(total=len(payload), unit="B", unit_scale=True, desc="upload", disable=not progress, leave=False) as bar:
        for start in range(0, len(payload), chunk_bytes):
            piece = view[start:start + chunk_bytes]
            yield gym_pb2.SubmitRequest(chunk=bytes(piece))
            bar.update(len(piece))


def register_request(key: Ed25519PrivateKey, display_name: str, *, invite: str = "") -> gym_pb2.RegisterRequest:
    """A signed RegisterRequest; the signature also covers `invite` (a `gym-server invite` token) when given."""
    public = signing.public_bytes(key)
    nonce = signing.new_nonce()
    signed = display_name + "\n" + invite if invite else display_name
    message = signing.canonical_bytes(method="Register", contributor=signing.contributor_id(public), round_id=0,
                                      payload_sha256=codec.sha256_hex(signed.encode()), nonce=nonce)
    return gym_pb2.RegisterRequest(public_key=public, display_name=display_name, nonce=nonce,
                                   signature=signing.sign(key, message), invite=invite)


def query_signature(method: str, key: Ed25519PrivateKey, contributor_id: str, *,
                    now: float | None = None) -> dict:
    """The fields that say who asks a read-only query (`signing.QUERIES`): contributor_id, nonce, signed_at_unix
    and signature. Build them fresh per call: the server accepts them only within a few minutes of `now`."""
    signed_at = int(time.time() if now is None else now)
    nonce = signing.new_nonce()
    message = signing.query_bytes(method, contributor=contributor_id, signed_at_unix=signed_at, nonce=nonce)
    return {"contributor_id": contributor_id, "nonce": nonce, "signed_at_unix": signed_at,
            "signature": signing.sign(key, message)}


def get_round_request(key: Ed25519PrivateKey, contributor_id: str, *,
                      now: float | None = None) -> gym_pb2.GetRoundRequest:
    """A GetRoundRequest signed by `key`, so the server answers you_submitted for this contributor only
    (an unsigned one gets you_submitted=false)."""
    return gym_pb2.GetRoundRequest(**query_signature("GetRound", key, contributor_id, now=now))
