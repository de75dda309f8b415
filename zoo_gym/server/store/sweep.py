"""Start-up sweep of what a crash can leave behind: blobs no row references (a checkpoint row references
its archive and, through its manifest, its float32 master), the blob store's temporary files, and
scratch directories under work/.

Every blob a row references was committed under the write lock together with (or before) that row
(handlers.submit_delta, publish.publish_round), so a blob without a row is garbage from an interrupted
publish or refusal. `gym-server serve` runs this once it holds the state directory's lock and before it
accepts connections, so no upload or publish is in flight.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass

from sqlmodel import select

from zoo_gym.server.store.checkpoint_writer import master_sha256
from zoo_gym.server.store.models import Checkpoint, Submission
from zoo_gym.server.store.state import ServerState

_CHECKPOINT_CACHE = "checkpoints"  # work/checkpoints/<sha256>: unpacked published checkpoints


@dataclass(frozen=True)
class SweepReport:
    blobs: int  # unreferenced blobs removed
    blob_bytes: int
    scratch: int  # temporary files and scratch directories removed

    def __str__(self) -> str:
        return (f"swept {self.blobs} unreferenced blob(s) ({self.blob_bytes} bytes) and {self.scratch} "
                "leftover temporary file(s)")


def sweep_storage(state: ServerState) -> SweepReport:
    """Remove what no row references; never touches a referenced blob or an unpacked published checkpoint."""
    with state.write_session() as s:
        checkpoints = set(s.exec(select(Checkpoint.sha256)))
        masters = {master_sha256(m) for m in s.exec(select(Checkpoint.manifest_json))} - {None}
        referenced = set(s.exec(select(Submission.payload_sha256))) | checkpoints | masters
        n_blobs = n_bytes = 0
        for path in sorted((state.blobs.root / "sha256").glob("*/*")):
            if path.is_file() and path.name not in referenced:
                n_bytes += path.stat().st_size
                state.blobs.remove(path.name)
                n_blobs += 1
        scratch = state.blobs.clean_tmp()
        for path in sorted(state.work_dir.iterdir()):
            if path.name == _CHECKPOINT_CACHE:
                for unpacked in sorted(path.iterdir()):
                    if unpacked.name not in checkpoints:
                        _remove(unpacked)
                        scratch += 1
            else:
                _remove(path)
                scratch += 1
    return SweepReport(blobs=n_blobs, blob_bytes=n_bytes, scratch=scratch)


def _remove(path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)
