"""Resumable, verified checkpoint download into the client's cache."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable
from pathlib import Path

from tqdm import tqdm

from zoo_gym.proto import archive, gym_pb2


class DownloadError(RuntimeError):
    """The downloaded bytes do not match the checkpoint's sha256 or size."""


def fetch_checkpoint(stub, sha256: str, size: int, workdir: Path, *, progress: bool = True,
                     retry: Callable | None = None, server_key: bytes | None = None, round_info=None,
                     say: Callable[[str], None] | None = None) -> Path:
    """Return the unpacked model directory of checkpoint `sha256`, downloading what is missing.

    Bytes land in `<workdir>/downloads/<sha>.partial`; an interrupted download resumes from its size.
    The archive is verified against `sha256` before it is unpacked to `<workdir>/checkpoints/<sha>/`:
    pass the sha256 of a RoundInfo whose server signature was verified. With `server_key` (the pinned
    server key) the unpacked lineage manifest's server signature is checked too; a checkpoint that fails
    is removed and DownloadError raised. A manifest published before lineages were signed (the first release,
    0.1.0) passes only with `round_info`, the server-signed RoundInfo naming `sha256`, when the directory
    packs back to that sha256; `say` is told so in one line (server_signatures.verify_lineage).
    """
    model_dir = workdir / "checkpoints" / sha256
    if (model_dir / archive.WEIGHTS).is_file():
        return _checked_lineage(model_dir, server_key, round_info, say)
    downloads = workdir / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    partial = downloads / f"{sha256}.partial"

    digest = hashlib.sha256()
    hashed = 0  # bytes of the partial file already fed to `digest`

    def attempt() -> None:
        nonlocal digest, hashed
        have = partial.stat().st_size if partial.exists() else 0
        if have > size:
            partial.unlink()
            have = 0
        if hashed != have:  # resuming: hash what an earlier run left, once
            digest, hashed = hashlib.sha256(), 0
            with open(partial, "rb") as f:
                while chunk := f.read(1 << 20):
                    digest.update(chunk)
                    hashed += len(chunk)
        if have == size:
            return
        bar = tqdm(total=size, initial=have, unit="B", unit_scale=True, desc=f"download {sha256[:12]}",
                   disable=not progress, leave=False)
        with open(partial, "ab") as f:
            for chunk in stub.DownloadCheckpoint(gym_pb2.DownloadRequest(checkpoint_sha256=sha256, offset=have)):
                if chunk.offset != f.tell():
                    raise DownloadError(f"server sent offset {chunk.offset}, expected {f.tell()}")
                f.write(chunk.data)
                digest.update(chunk.data)
                hashed += len(chunk.data)
                bar.update(len(chunk.data))
        bar.close()

    (retry or (lambda c: c()))(attempt)
    if partial.stat().st_size != size or hashed != size or digest.hexdigest() != sha256:
        partial.unlink()
        raise DownloadError(f"checkpoint {sha256[:12]} failed verification (size or sha256); it was discarded, "
                            "run again to download it afresh")
    archive.unpack(partial, model_dir)
    partial.unlink()
    return _checked_lineage(model_dir, server_key, round_info, say)


def _checked_lineage(model_dir: Path, server_key: bytes | None, round_info,
                     say: Callable[[str], None] | None) -> Path:
    if server_key is None:
        return model_dir
    from zoo_gym.client.known_servers import UntrustedServer
    from zoo_gym.client.server_signatures import verify_lineage

    try:
        checked = verify_lineage(model_dir, server_key=server_key, round_info=round_info)
    except UntrustedServer as exc:
        shutil.rmtree(model_dir, ignore_errors=True)
        raise DownloadError(f"checkpoint {model_dir.name[:12]}: {exc}; it was discarded") from None
    if checked.note is not None and say is not None:
        say(checked.note)
    return model_dir
