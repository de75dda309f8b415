"""`gym-server mirror-sync DIR`: each stored published checkpoint copied into DIR as DIR/<sha256>, the layout
a checkpoint mirror serves (`--mirror URL`: a checkpoint at URL/<sha256>; docs/design/SCALE-OUT.md).

A file already in DIR with the checkpoint's size and sha256 is left alone (its size only, `verify=False`);
any other file of that name is replaced. A copy is hashed while it is written to a temporary file in DIR,
fsynced, made world-readable and renamed into place, so a web server serving DIR never serves half a
checkpoint or a corrupt one. Checkpoints whose files retention removed (--keep-checkpoints) are reported
as gone. Reads the state only: it runs beside a serving server.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from sqlmodel import select

from zoo_gym.server.store.blobs import BlobError
from zoo_gym.server.store.models import Checkpoint

_READ = 1 << 20


@dataclass
class SyncReport:
    dir: str
    copied: list[str] = field(default_factory=list)  # sha256s written this run
    present: list[str] = field(default_factory=list)  # already there, right size (and sha256 when verified)
    gone: list[str] = field(default_factory=list)  # published, but no longer stored here (retention)
    bytes_copied: int = 0

    def line(self) -> str:
        gone = f"; {len(self.gone)} no longer stored here" if self.gone else ""
        return (f"copied {len(self.copied)} checkpoint(s) ({self.bytes_copied} bytes) into {self.dir}; "
                f"{len(self.present)} already there{gone}")


def mirror_sync(state, out: Path, *, verify: bool = True) -> SyncReport:
    """Copy every published checkpoint the state still stores into `out` (created if absent)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with state.session() as s:
        rows = [(c.sha256, c.size) for c in s.exec(select(Checkpoint).order_by(Checkpoint.round_id)).all()]
    report = SyncReport(dir=str(out))
    for sha, size in rows:
        if not state.blobs.exists(sha):
            report.gone.append(sha)
        elif _present(out / sha, sha, size, verify=verify):
            report.present.append(sha)
        else:
            report.bytes_copied += _copy(state.blobs.path(sha), out, sha)
            report.copied.append(sha)
    return report


def _present(path: Path, sha: str, size: int, *, verify: bool) -> bool:
    if not path.is_file() or path.stat().st_size != size:
        return False
    return not verify or _sha256(path) == sha


def _copy(src: Path, out: Path, sha: str) -> int:
    """Write `src` to out/<sha> through a temporary file; BlobError (nothing left behind) if it hashes otherwise."""
    fd, name = tempfile.mkstemp(dir=out, prefix=f".{sha[:12]}-", suffix=".tmp")
    tmp = Path(name)
    try:
        digest, n = hashlib.sha256(), 0
        with os.fdopen(fd, "wb") as dst, open(src, "rb") as f:
            while chunk := f.read(_READ):
                dst.write(chunk)
                digest.update(chunk)
                n += len(chunk)
            dst.flush()
            os.fsync(dst.fileno())
        if digest.hexdigest() != sha:
            raise BlobError(f"the stored checkpoint {src} does not hash to its name {sha[:12]}: not copied "
                            "(the state's disk may be failing)")
        os.chmod(tmp, 0o644)  # the web server's user reads it
        os.replace(tmp, out / sha)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(out, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    return n


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()
