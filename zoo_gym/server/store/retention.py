"""`--keep-checkpoints N`: the genesis and the N newest published checkpoints keep their blobs; the rest are swept.

A swept checkpoint loses its archive, its float32 master and its unpacked copy under work/; its row (lineage,
held-out loss, manifest), its round's record and the ledger stay. The submissions of a published round whose
base is not among the N newest published checkpoints lose their payload blobs too (the rows stay): with
N = 1 the directory holds the genesis, the current base with its master, and the open round's uploads.
Idempotent: run after each publish's commit and at `serve` start (a crash between the two loses nothing).
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

from sqlmodel import select

from zoo_gym.server.store.checkpoint_writer import master_sha256
from zoo_gym.server.store.models import Checkpoint, Round, RoundState, Submission
from zoo_gym.server.store.state import ServerState


@dataclass(frozen=True)
class RetentionReport:
    checkpoints: int  # checkpoints whose blobs were removed now
    submissions: int  # payload blobs removed now
    bytes: int

    def __str__(self) -> str:
        return (f"--keep-checkpoints: swept {self.checkpoints} checkpoint(s) and {self.submissions} submission "
                f"payload(s), {self.bytes} bytes")


def kept_checkpoints(session, *, keep: int | None) -> tuple[set[str], set[str]] | None:
    """(the genesis, the `keep` newest published checkpoints): the sha256 whose blobs are kept (None: all are)."""
    if keep is None:
        return None
    rows = session.exec(select(Checkpoint.sha256, Checkpoint.round_id).order_by(Checkpoint.round_id.desc())).all()
    return {sha for sha, rid in rows if rid == 0}, set([sha for sha, rid in rows if rid > 0][:keep])


def is_swept(state: ServerState, sha256: str) -> bool:
    """True when `sha256` is a checkpoint with a row whose archive is no longer stored."""
    with state.session() as s:
        return s.get(Checkpoint, sha256) is not None and not state.blobs.exists(sha256)


def retire_checkpoints(state: ServerState, *, keep: int | None) -> RetentionReport:
    """Remove the blobs of the checkpoints (and published rounds' submissions) past `keep`; see the module."""
    if keep is None:
        return RetentionReport(0, 0, 0)
    n_ckpt = n_subs = n_bytes = 0
    # One write session to the end: no submission (of this process or an ingest process) can commit a row
    # naming one of these blobs between the query and the removal.
    with state.write_session() as s:
        genesis, newest = kept_checkpoints(s, keep=keep)
        gone = [c for c in s.exec(select(Checkpoint)) if c.sha256 not in genesis | newest]
        stale_rounds = {r.id for r in s.exec(select(Round).where(Round.state == RoundState.PUBLISHED))
                        if r.base_sha256 not in newest}
        subs = s.exec(select(Submission.round_id, Submission.payload_sha256)).all()
        for c in gone:
            removed = sum(_remove_blob(state, sha) for sha in (c.sha256, master_sha256(c.manifest_json)))
            shutil.rmtree(state.work_dir / "checkpoints" / c.sha256, ignore_errors=True)
            n_ckpt += removed > 0
            n_bytes += removed
        keep_payloads = {sha for rid, sha in subs if rid not in stale_rounds}
        for sha in {sha for rid, sha in subs if rid in stale_rounds} - keep_payloads:
            removed = _remove_blob(state, sha)
            n_subs += removed > 0
            n_bytes += removed
    return RetentionReport(n_ckpt, n_subs, n_bytes)


def _remove_blob(state: ServerState, sha: str | None) -> int:
    """Bytes removed (0 when the blob is not there)."""
    if sha is None or not state.blobs.exists(sha):
        return 0
    size = state.blobs.size(sha)
    state.blobs.remove(sha)
    return size
