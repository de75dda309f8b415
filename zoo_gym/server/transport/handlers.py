"""What each RPC does, free of gRPC: handlers take plain values and the server state, raise GymError.

The servicer (servicer.py) turns requests into these calls and GymError into status codes. Every check
runs before anything is stored, and a submission is acknowledged only after its blob is fsynced and its
row committed.
"""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections.abc import Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from sqlalchemy.exc import IntegrityError
from sqlmodel import col, func, select

from zoo_gym import codec
from zoo_gym.aggregation.privacy import rdp_epsilon
from zoo_gym.proto import signing
from zoo_gym.server.transport.admission import Admission, shared_wait
from zoo_gym.server.store.blobs import BlobError, map_file
from zoo_gym.io.safetensors_reader import SafetensorsReader
from zoo_gym.server.config import ServerConfig
from zoo_gym.server.errors import (
    AlreadyExists,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
)
from zoo_gym.server.store.models import (
    Checkpoint,
    Contributor,
    Round,
    RoundState,
    SpentInvite,
    Submission,
    UsedNonce,
    utcnow,
)
from zoo_gym.server.rounds import sampling
from zoo_gym.server.rounds.privacy_history import published_history
from zoo_gym.server.store.state import ServerState

_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_ID = re.compile(r"^[0-9a-f]{32}$")
FLOAT_DTYPES = ("float32", "bfloat16", "float16")


# ----------------------------------------------------------------------------------------------- register

def register(*, public_key: bytes, display_name: str, nonce: bytes, signature: bytes, state: ServerState,
             admission: Admission, peer: str = "", invite: str = "") -> tuple[str, bool]:
    """Register a key after checking its proof of possession. Returns (contributor_id, created).

    A key already registered gets its id back and nothing is written (no bucket token, no row). A new key
    must pass `admission` (rate limits; in invite mode an unspent invitation, spent here with the row)."""
    if len(public_key) != 32:
        raise InvalidArgument(f"public_key must be a raw 32-byte Ed25519 key, got {len(public_key)} bytes")
    if len(display_name) > 64 or any(c in display_name for c in "\r\n\0"):
        raise InvalidArgument("display_name must be at most 64 characters on one line")
    cid = signing.contributor_id(public_key)
    signed = display_name + "\n" + invite if invite else display_name
    try:
        message = signing.canonical_bytes(method="Register", contributor=cid, round_id=0,
                                          payload_sha256=codec.sha256_hex(signed.encode()), nonce=nonce)
    except signing.SignatureError as exc:
        raise InvalidArgument(str(exc)) from exc
    try:
        signing.verify(public_key, signature, message)
    except signing.SignatureError as exc:
        raise Unauthenticated(f"proof of possession failed: {exc}") from exc
    with state.session() as s:  # a known key: read only
        if s.get(UsedNonce, (cid, nonce.hex())) is not None:
            raise AlreadyExists("this nonce was already used: a replayed Register request is refused")
        if s.get(Contributor, cid) is not None:
            return cid, False
    invite_id = admission.admit_new(peer=peer, invite=invite)
    with state.write_session() as s:
        if s.get(Contributor, cid) is not None:  # registered meanwhile by a concurrent request
            return cid, False
        if invite_id is not None:
            if s.get(SpentInvite, invite_id) is not None:
                raise PermissionDenied("this invite was already used (each admits one key): ask the operator "
                                       "for a new one")
            s.add(SpentInvite(id=invite_id, contributor_id=cid))
        else:
            _check_shared_limit(s, admission.limiter)
        s.add(UsedNonce(contributor_id=cid, nonce=nonce.hex(), method="Register"))
        s.add(Contributor(id=cid, public_key=public_key.hex(), display_name=display_name))
        s.commit()
    return cid, True


def _check_shared_limit(s, limiter) -> None:
    """The server-wide limit on uninvited keys, over every process of the database (admission.shared_wait): read
    in the caller's write session, so two processes never both take the last place."""
    burst = limiter.global_burst
    invited = select(SpentInvite.contributor_id)
    recent = s.exec(select(Contributor.registered_at).where(col(Contributor.id).not_in(invited))
                    .order_by(col(Contributor.registered_at).desc()).limit(burst)).all()
    wait = shared_wait(list(recent), per_minute=limiter.global_per_minute, burst=burst, now=utcnow())
    if wait > 0:
        raise ResourceExhausted(f"too many new contributors registered on this server recently (all its addresses):"
                                f" try again in {math.ceil(wait)} s (an already registered key is never limited)")


# ----------------------------------------------------------------------------------------------- queries

SQL_INT_MAX = (1 << 63) - 1  # SQLite and PostgreSQL BIGINT: a larger wire integer cannot even be compared


def check_contributor_id(contributor_id: str, *, field: str = "contributor_id", required: bool = True) -> None:
    """A contributor id is the 32 lowercase hex characters Register returned."""
    if not contributor_id and not required:
        return
    if not _ID.match(contributor_id or ""):
        raise InvalidArgument(f"{field} must be the 32-hex id returned by Register, got {contributor_id[:40]!r}")


def check_ledger_query(*, contributor_id: str, since_seq: int) -> None:
    """Range checks of a LedgerRequest before any query (SQL integers stop at 2^63 - 1)."""
    check_contributor_id(contributor_id, required=False)
    if not 0 <= since_seq <= SQL_INT_MAX:
        raise InvalidArgument(f"since_seq must be in [0, 2^63 - 1], got {since_seq}")


# ----------------------------------------------------------------------------------------------- rounds

@dataclass(frozen=True)
class RoundView:
    round: Round
    base_size: int
    submissions: int
    you_submitted: bool
    dp_epsilon_spent: float
    dp_epsilon_round: float = 0.0
    dp_epsilon_spent_rdp: float = 0.0
    selected_count: int = 0
    selected: bool = False  # the signed asker, when sampling


def _privacy_figures(s, delta: float) -> tuple[float, float, float]:
    """(cumulative epsilon, the last round's, RDP's cumulative cross-check) of the published rounds, as the last
    DP round stored them when it published.

    Columns, not Round objects: the caller's session may already hold a round as it was before its publish
    committed (the view loads the current round first), and a query hands back such an object unrefreshed."""
    last = s.exec(select(Round.id, Round.dp_epsilon_total, Round.dp_epsilon_round, Round.dp_epsilon_total_rdp)
                  .where(Round.dp_noise_multiplier.is_not(None), Round.state == RoundState.PUBLISHED)
                  .order_by(Round.id.desc()).limit(1)).first()
    if last is None:
        return 0.0, 0.0, 0.0
    last_id, total, last_round, total_rdp = last
    if total_rdp is None:  # published before 0007 stored it: computed from the history, once per such round
        total_rdp = _legacy_rdp(s, last_id, delta)
    return float(total or 0.0), float(last_round or 0.0), float(total_rdp)


def _legacy_rdp(s, last_id: int, delta: float) -> float:
    """RDP's cumulative figure from the published history, for a last DP round that did not store it (cached)."""
    history = published_history(s)
    key = (str(s.get_bind().url), last_id, len(history), delta)
    if key not in _RDP_CROSS_CHECK:
        if len(_RDP_CROSS_CHECK) > 64:
            _RDP_CROSS_CHECK.clear()
        _RDP_CROSS_CHECK[key] = rdp_epsilon(history, delta=delta)
    return _RDP_CROSS_CHECK[key]


_RDP_CROSS_CHECK: dict[tuple, float] = {}  # (database, last DP round published, their count, delta) -> RDP epsilon


def _selection(s, state: ServerState, rnd: Round, contributor_id: str, q: float) -> tuple[int, bool]:
    if q >= 1.0:
        return 0, False
    chosen = sampling.selected_ids(s, sampling.selection_key(state.key), rnd, q)
    return len(chosen), bool(contributor_id) and contributor_id in chosen


GET_ROUND_SKEW_S = 300  # a signed GetRound is accepted this many seconds either side of the server's clock


def signed_asker(s, *, contributor_id: str, nonce: bytes, signed_at_unix: int, signature: bytes,
                 method: str = "GetRound") -> str:
    """The contributor who signed a read-only query (`method`: GetRound, GetBalance, StreamLedger): "" when the
    request is unsigned. What the asker may then learn: its own you_submitted, balance, ledger entries whole.

    Raises Unauthenticated for a signature that does not verify against the registered key, an unknown
    contributor, or a signed_at_unix outside the clock-skew window. GetRound writes nothing, so its nonce
    is not stored: a replay is possible only within the window, and it tells the replayer no more than
    the owner's own answer in those minutes (and TLS keeps the request from eavesdroppers)."""
    check_contributor_id(contributor_id, required=False)
    if not signature:
        return ""
    if not contributor_id:
        raise InvalidArgument(f"a signed {method} must name its contributor_id")
    if len(nonce) != signing.NONCE_BYTES:
        raise InvalidArgument(f"nonce must be {signing.NONCE_BYTES} random bytes")
    skew = signed_at_unix - int(time.time())
    if abs(skew) > GET_ROUND_SKEW_S:
        raise Unauthenticated(f"signed_at_unix is {skew:+d} s from the server's clock (at most "
                              f"{GET_ROUND_SKEW_S} s either way): set this machine's clock, then sign again")
    contributor = s.get(Contributor, contributor_id)
    if contributor is None and method != "GetRound":  # a key that never registered owns nothing: it asks as anyone
        return ""
    if contributor is None:
        raise Unauthenticated(f"contributor {contributor_id} is not registered; call Register first")
    message = signing.query_bytes(method, contributor=contributor_id, signed_at_unix=signed_at_unix, nonce=nonce)
    try:
        signing.verify(bytes.fromhex(contributor.public_key), signature, message)
    except signing.SignatureError as exc:
        raise Unauthenticated(f"{method} signature: {exc}") from exc
    return contributor_id


# What a ledger entry of someone else shows under DP: the fields that let the chain verify (links, the server's
# signature over entry_hash), none computed from the un-noised delta (kind, amount, score, reputation, reason).
_WITHHELD = {"kind": "", "amount": 0, "score": 0.0, "reputation_after": 0.0, "reason": ""}


def private_ledger_view(entries: list[dict], *, asker: str, participation: str) -> list[dict]:
    """Entries as a stranger may see them with DP on: the asker's own whole, everyone else's redacted, and with
    participation private without whose they are either."""
    withheld = {**_WITHHELD, "contributor_id": ""} if participation == "private" else _WITHHELD
    return [e if asker and e["contributor_id"] == asker else {**e, **withheld, "redacted": True} for e in entries]


def round_view(*, state: ServerState, contributor_id: str = "", nonce: bytes = b"", signed_at_unix: int = 0,
               signature: bytes = b"", sample_rate: float = 1.0, dp_delta: float = 1e-5) -> RoundView:
    """The current round; you_submitted only for a contributor who signed the request (see signed_asker)."""
    with state.session() as s:
        contributor_id = signed_asker(s, contributor_id=contributor_id, nonce=nonce,
                                      signed_at_unix=signed_at_unix, signature=signature)
        rnd = state.current_round(s)
        if rnd is None:
            raise FailedPrecondition("the server has no round; initialise it with `gym-server init`")
        count = s.exec(select(func.count()).select_from(Submission).where(Submission.round_id == rnd.id)).one()
        mine = bool(contributor_id) and s.exec(
            select(Submission.id).where(Submission.round_id == rnd.id, Submission.contributor_id == contributor_id)
        ).first() is not None
        spent, eps_round, eps_rdp = _privacy_figures(s, dp_delta)
        ckpt = s.get(Checkpoint, rnd.base_sha256)
        selected_count, selected = _selection(s, state, rnd, contributor_id, sample_rate)
    return RoundView(rnd, ckpt.size if ckpt else 0, int(count), mine, spent, eps_round, eps_rdp,
                     selected_count, selected)


# ----------------------------------------------------------------------------------------------- download

def download(*, sha256: str, offset: int, state: ServerState, config: ServerConfig) -> Iterator[tuple[int, bytes, int]]:
    """Yield (offset, data, total_size) chunks of a published checkpoint from `offset`."""
    if not _HEX64.match(sha256):
        raise InvalidArgument("checkpoint_sha256 must be 64 lowercase hex characters (RoundInfo.base_sha256)")
    with state.session() as s:
        if s.get(Checkpoint, sha256) is None:
            raise NotFound(f"no published checkpoint has sha256 {sha256}")
    if not state.blobs.exists(sha256):
        raise NotFound(f"checkpoint {sha256[:12]} is no longer stored: this server keeps only the genesis and its "
                       "newest checkpoints (--keep-checkpoints); pull the current round's base (GetRound)")
    total = state.blobs.size(sha256)
    if offset > total:
        raise InvalidArgument(f"offset {offset} is past the end of the checkpoint ({total} bytes)")
    step = config.download_chunk_bytes
    with open(state.blobs.path(sha256), "rb") as f:
        f.seek(offset)
        pos = offset
        while pos < total:
            data = f.read(min(step, total - pos))
            if not data:
                break
            yield pos, data, total
            pos += len(data)


# ----------------------------------------------------------------------------------------------- submit

@dataclass(frozen=True)
class SubmitHeader:
    contributor_id: str
    round_id: int
    base_sha256: str
    payload_sha256: str
    payload_size: int
    manifest: tuple[tuple[str, tuple[int, ...], str, str], ...]  # (name, shape, dtype, codec)
    nonce: bytes
    signature: bytes
    metadata_json: str


@lru_cache(maxsize=8)
def _base_manifest(archive_path: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """name -> (shape, dtype) of a checkpoint's weights, read from the header inside its archive blob
    (no unpacked copy: at a real size unpacking would write the whole model again)."""
    with SafetensorsReader.in_archive(Path(archive_path)) as r:
        return {name: (info.shape, info.dtype) for name, info in r.infos.items()}


def base_manifest(state: ServerState, sha256: str) -> dict[str, tuple[tuple[int, ...], str]]:
    return _base_manifest(str(state.blobs.path(sha256)))


def _check_header(h: SubmitHeader, state: ServerState, config: ServerConfig, policy) -> tuple[Round, bytes]:
    if not _ID.match(h.contributor_id):
        raise InvalidArgument("contributor_id must be the 32-hex id returned by Register")
    for field_name in ("base_sha256", "payload_sha256"):
        if not _HEX64.match(getattr(h, field_name)):
            raise InvalidArgument(f"{field_name} must be 64 lowercase hex characters")
    if len(h.nonce) != signing.NONCE_BYTES:
        raise InvalidArgument(f"nonce must be {signing.NONCE_BYTES} random bytes")
    if h.payload_size == 0:
        raise InvalidArgument("payload_size is 0: an empty delta is not a contribution")
    if h.payload_size > config.max_payload_bytes:
        raise ResourceExhausted(
            f"payload of {h.payload_size} bytes exceeds the server's limit of {config.max_payload_bytes} bytes")
    with state.session() as s:
        contributor = s.get(Contributor, h.contributor_id)
        if contributor is None:
            raise Unauthenticated(f"contributor {h.contributor_id} is not registered; call Register first")
        message = signing.canonical_bytes(method="SubmitDelta", contributor=h.contributor_id, round_id=h.round_id,
                                          payload_sha256=h.payload_sha256, nonce=h.nonce, base_sha256=h.base_sha256)
        try:
            signing.verify(bytes.fromhex(contributor.public_key), h.signature, message)
        except signing.SignatureError as exc:
            raise Unauthenticated(f"submission header signature: {exc}") from exc
        if s.get(UsedNonce, (h.contributor_id, h.nonce.hex())) is not None:
            raise AlreadyExists("this nonce was already used: a replayed submission is refused")
        rnd = state.current_round(s)
        policy.check_base(s, rnd, round_id=h.round_id, base_sha256=h.base_sha256, contributor_id=h.contributor_id)
        sampling.check_may_submit(s, sampling.selection_key(state.key), rnd, h.contributor_id, q=config.sample_rate,
                                  holds=policy.holds(rnd))
    return rnd, bytes.fromhex(contributor.public_key)


def _check_payload(payload, h: SubmitHeader, base: dict[str, tuple[tuple[int, ...], str]],
                   config: ServerConfig) -> list[str]:
    """Validate the payload against the header's manifest and the base; return the codecs used."""
    try:
        manifest = codec.read_manifest(payload)
    except codec.CodecError as exc:
        raise InvalidArgument(f"payload is not a valid delta: {exc}") from exc
    declared = {(e.name, tuple(int(d) for d in e.shape), e.dtype, e.codec) for e in manifest.entries}
    if declared != set(h.manifest):
        raise InvalidArgument("the header's manifest does not match the tensors the payload declares")
    codecs_used = sorted({e.codec for e in manifest.entries})
    for e in manifest.entries:
        if e.name not in base:
            raise InvalidArgument(f"tensor {e.name!r} is not a parameter of the base checkpoint")
        shape = tuple(int(d) for d in e.shape)
        if shape != base[e.name][0]:
            raise InvalidArgument(f"tensor {e.name!r} has shape {list(shape)}, the base has {list(base[e.name][0])}")
        if e.dtype not in FLOAT_DTYPES:
            raise InvalidArgument(f"tensor {e.name!r} has dtype {e.dtype}; deltas are float32, bfloat16 or float16")
    norm = math.sqrt(sum(_sq_norm(payload, manifest, e) for e in manifest.entries))
    if norm == 0.0:
        raise InvalidArgument("the delta is all zeros: there is nothing to contribute (train first)")
    if config.soup.max_delta_norm and norm > config.soup.max_delta_norm:
        raise InvalidArgument(f"the delta's L2 norm {norm:.4g} exceeds the server's limit "
                              f"{config.soup.max_delta_norm}")
    return codecs_used


def _sq_norm(payload, manifest, e) -> float:
    """Tensor `e`'s squared L2 norm, refusing NaN or infinity. Float32 LoRA factors and BitDelta are measured from
    what was sent (`codec.sent_sq_norm`), as the round's validation does: decoding a LoRA tensor to check it was a
    full matrix product per upload, and with it the buffers that kept a busy server's RSS high. Anything else,
    or factors whose product could overflow, is decoded (one tensor at a time)."""
    try:
        sq = codec.sent_sq_norm(payload, e.name, manifest=manifest)
        if sq is not None:
            return sq
        t = codec.decode_tensor(payload, e.name, manifest=manifest)
    except codec.CodecError as exc:
        raise InvalidArgument(f"tensor {e.name!r}: {exc}") from exc
    t_norm = float(torch.linalg.vector_norm(t.float()))  # NaN/inf in t make this non-finite
    if not math.isfinite(t_norm):
        if not bool(torch.isfinite(t).all()):
            raise InvalidArgument(f"tensor {e.name!r} holds NaN or infinite values")
        t_norm = float(torch.linalg.vector_norm(t.double()))  # finite but huge: recompute exactly
    return t_norm * t_norm


class UploadGate:
    """At most one upload in flight per contributor: parallel streams from one key are refused at the
    header, before a byte is stored, so no key can fill the disk or the worker pool with twins."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy: set[str] = set()

    @contextmanager
    def hold(self, contributor_id: str) -> Iterator[None]:
        with self._lock:
            if contributor_id in self._busy:
                raise ResourceExhausted(f"another upload from contributor {contributor_id} is in progress; "
                                        "one upload at a time per contributor: wait for its answer")
            self._busy.add(contributor_id)
        try:
            yield
        finally:
            with self._lock:
                self._busy.discard(contributor_id)


def submit_delta(header: SubmitHeader, chunks: Iterable[bytes], *, state: ServerState,
                 config: ServerConfig, policy, gate: UploadGate) -> Submission:
    """Verify, receive, validate, store durably, then record. Raises GymError; stores nothing on error.

    The blob becomes visible in the store only under the write lock, after the round and the nonce
    were checked again there, and in the same critical section as the row's commit: a refusal at any
    stage leaves neither a blob nor a temporary file.
    """
    rnd, _ = _check_header(header, state, config, policy)
    try:
        meta = json.loads(header.metadata_json or "{}")
        if not isinstance(meta, dict):
            raise ValueError("not an object")
    except (ValueError, RecursionError) as exc:  # unsigned bytes: "[" * 10**5 exhausts the parser's recursion
        raise InvalidArgument(f"metadata_json must be a JSON object: {str(exc)[:200]}") from exc
    base = base_manifest(state, rnd.base_sha256)
    with gate.hold(header.contributor_id), state.blobs.writer() as w:
        for chunk in chunks:
            if not chunk:
                raise InvalidArgument("an empty chunk carries nothing; send data or end the stream")
            if len(chunk) > config.max_chunk_bytes:
                raise ResourceExhausted(f"a chunk of {len(chunk)} bytes exceeds the limit of "
                                        f"{config.max_chunk_bytes} bytes; send smaller chunks")
            if w.size + len(chunk) > header.payload_size:
                raise InvalidArgument(f"more bytes arrived than the declared payload_size {header.payload_size}")
            w.write(chunk)
        if w.size != header.payload_size:
            raise InvalidArgument(f"the stream ended after {w.size} of the declared {header.payload_size} bytes")
        if w.sha256 != header.payload_sha256:
            raise InvalidArgument("the payload's sha256 does not match the signed payload_sha256")
        # Durability and validation are both needed before the answer: run the fsync beside the check.
        w.flush()  # every byte readable through the path before the check maps it
        with ThreadPoolExecutor(max_workers=1) as pool:
            synced = pool.submit(w.sync)
            with map_file(w.path) as payload:
                codecs_used = _check_payload(payload, header, base, config)
            synced.result()
        sub = Submission(round_id=rnd.id, contributor_id=header.contributor_id, base_sha256=header.base_sha256,
                         payload_sha256=header.payload_sha256, payload_size=header.payload_size,
                         codecs=",".join(codecs_used), metadata_json=json.dumps(meta, sort_keys=True))
        with state.write_session() as s:
            # Re-check under the lock: the round may have closed, or a twin request won the race.
            rnd = state.current_round(s)  # async: a flush may have opened the next buffer meanwhile
            policy.check_base(s, rnd, round_id=header.round_id, base_sha256=header.base_sha256,
                              contributor_id=header.contributor_id)
            sampling.check_may_submit(s, sampling.selection_key(state.key), rnd, header.contributor_id, q=config.sample_rate,
                                      holds=policy.holds(rnd))
            sub.round_id = policy.stored_under(s, rnd)  # async: the next buffer when this one is full
            if s.get(UsedNonce, (header.contributor_id, header.nonce.hex())) is not None:
                raise AlreadyExists("this nonce was already used: a replayed submission is refused")
            existed = state.blobs.exists(header.payload_sha256)  # the same bytes may back another row
            try:
                w.commit(expect_sha256=header.payload_sha256)
            except BlobError as exc:
                raise InvalidArgument(str(exc)) from exc
            s.add(UsedNonce(contributor_id=header.contributor_id, nonce=header.nonce.hex(), method="SubmitDelta"))
            s.add(sub)
            try:
                s.commit()
            except BaseException as exc:
                s.rollback()
                if not existed:
                    state.blobs.remove(header.payload_sha256)
                if isinstance(exc, IntegrityError):
                    raise AlreadyExists(f"contributor {header.contributor_id} already submitted to round "
                                        f"{sub.round_id}") from exc
                raise
            s.refresh(sub)
    return sub


