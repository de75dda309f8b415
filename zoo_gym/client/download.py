"""Resumable, verified checkpoint download into the client's cache: from the server's mirrors first when its
signed RoundInfo names any (client/mirrors.py), else (or when none serves it) from the server."""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from zoo_gym.proto import archive, gym_pb2


class DownloadError(RuntimeError):
    """The downloaded bytes do not match the checkpoint's sha256 or size."""


@dataclass(frozen=True)
class Fetched:
    model_dir: Path
    source: str  # "cache" (unpacked before), "server" (DownloadCheckpoint) or the mirror's base URL


def fetch_checkpoint(stub, sha256: str, size: int, workdir: Path, **options) -> Path:
    """The unpacked model directory of checkpoint `sha256` (`fetch` with the same arguments, its model_dir)."""
    return fetch(stub, sha256, size, workdir, **options).model_dir


def fetch(stub, sha256: str, size: int, workdir: Path, *, progress: bool = True, retry: Callable | None = None,
          server_key: bytes | None = None, round_info=None, say: Callable[[str], None] | None = None,
          mirrors: Sequence[str] | None = None, mirror_policy=None) -> Fetched:
    """Return the unpacked model directory of checkpoint `sha256`, downloading what is missing, and its source.

    Bytes land in `<workdir>/downloads/<sha>.partial`; an interrupted download resumes from its size. The
    `mirrors` (default: those of `round_info`, which the server signed) are tried first, in order
    (client/mirrors.py, under `mirror_policy`), then the server's DownloadCheckpoint.
    The archive is verified against `sha256` before it is unpacked to `<workdir>/checkpoints/<sha>/`:
    pass the sha256 of a RoundInfo whose server signature was verified. With `server_key` (the pinned
    server key) the unpacked lineage manifest's server signature is checked too; a checkpoint that fails
    is removed and DownloadError raised. A manifest published before lineages were signed (the first release,
    0.1.0) passes only with `round_info`, the server-signed RoundInfo naming `sha256`, when the directory
    packs back to that sha256; `say` is told so in one line (server_signatures.verify_lineage).
    """
    model_dir = workdir / "checkpoints" / sha256
    if (model_dir / archive.WEIGHTS).is_file():
        return Fetched(_checked_lineage(model_dir, server_key, round_info, say), "cache")
    downloads = workdir / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    partial = downloads / f"{sha256}.partial"
    if mirrors is None:
        mirrors = list(getattr(round_info, "mirrors", ()) or ())
    source = None
    if mirrors:
        from zoo_gym.client.mirrors import MirrorPolicy, from_mirrors

        try:
            mirror_policy = mirror_policy or MirrorPolicy.from_env()
        except ValueError as exc:
            raise DownloadError(str(exc)) from None
        with tqdm(total=size, initial=partial.stat().st_size if partial.exists() else 0, unit="B", unit_scale=True,
                  desc=f"mirror {sha256[:12]}", disable=not progress, leave=False) as bar:
            source = from_mirrors(mirrors, sha256, size, partial, policy=mirror_policy, say=say, progress=bar.update)
    if source is not None:
        if say is not None:
            say(f"checkpoint {sha256[:12]}: downloaded from mirror {source} (sha256 verified)")
    else:
        _from_server(stub, sha256, size, partial, progress=progress, retry=retry)
        source = "server"
    archive.unpack(partial, model_dir)
    partial.unlink()
    return Fetched(_checked_lineage(model_dir, server_key, round_info, say), source)


def _from_server(stub, sha256: str, size: int, partial: Path, *, progress: bool, retry: Callable | None) -> None:
    """Resume `partial` from the server's DownloadCheckpoint; DownloadError (the file removed) unless the
    whole file then hashes to `sha256`."""
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
