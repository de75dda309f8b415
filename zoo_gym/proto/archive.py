"""Checkpoints on the wire and on disk: a Hugging Face model directory packed as a deterministic tar.

The sha256 of that tar is the checkpoint's identity: every delta names it, the client verifies it after
downloading, and equal directories always give equal bytes (sorted names, zeroed times and owners).
Only flat directories of regular files are packed or unpacked; anything else is refused, so a hostile
archive cannot write outside the target directory.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tarfile
import tempfile
from pathlib import Path
from typing import BinaryIO

WEIGHTS = "model.safetensors"
LINEAGE = "zoo_gym_checkpoint.json"
_SAFE_NAME = re.compile(r"^[A-Za-z0-9._-]{1,128}$")


class CheckpointError(ValueError):
    """A checkpoint directory or archive is not what it must be."""


def pack(model_dir: Path, out: BinaryIO) -> None:
    """Write `model_dir`'s files as a deterministic uncompressed tar to `out`."""
    model_dir = Path(model_dir)
    names = sorted(p.name for p in model_dir.iterdir())
    if WEIGHTS not in names:
        raise CheckpointError(f"{model_dir} has no {WEIGHTS}: save the model with safe_serialization")
    with tarfile.open(fileobj=out, mode="w|", format=tarfile.USTAR_FORMAT) as tar:
        for name in names:
            path = model_dir / name
            if not path.is_file() or not _SAFE_NAME.match(name):
                raise CheckpointError(f"{path}: checkpoints hold only plain files with simple names")
            info = tarfile.TarInfo(name)
            info.size = path.stat().st_size
            info.mtime = 0
            info.mode = 0o644
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            with open(path, "rb") as f:
                tar.addfile(info, f)


def packed_sha256(model_dir: Path) -> str:
    """The sha256 of the archive `pack` writes for `model_dir`, computed without writing it: a directory
    unpacked from an archive packs back to that archive's bytes (the client checks a checkpoint whose
    lineage carries no server signature this way, zoo_gym/client/server_signatures.py)."""
    class _Digest:
        def __init__(self) -> None:
            self.h = hashlib.sha256()

        def write(self, data) -> int:
            self.h.update(data)
            return len(data)

    sink = _Digest()
    pack(model_dir, sink)  # type: ignore[arg-type]
    return sink.h.hexdigest()


class TarStream:
    """`pack`'s bytes, written member by member to `out` without the files existing first.

    A member is either whole bytes (`add_bytes`) or announced with its size and then streamed
    (`begin` ... `write` ... `end`), so the publisher can tee the new weights into the archive while
    it writes them (zoo_gym/server/store/checkpoint_writer.py). Members must come in sorted name order and
    `close` must be called: the output then equals `pack` of a directory holding the same files
    (tests/server/test_checkpoint_writer.py checks it byte for byte)."""

    def __init__(self, out: BinaryIO) -> None:
        self._out = out
        self._offset = 0
        self._last: str | None = None
        self._left: int | None = None  # bytes still owed by the open member

    def _emit(self, data) -> None:
        self._out.write(data)
        self._offset += len(data)

    def begin(self, name: str, size: int) -> None:
        if self._left is not None:
            raise CheckpointError(f"member {self._last!r} is still open")
        if not _SAFE_NAME.match(name) or (self._last is not None and name <= self._last):
            raise CheckpointError(f"archive members need simple names in sorted order: {name!r} after {self._last!r}")
        info = tarfile.TarInfo(name)
        info.size, info.mtime, info.mode = size, 0, 0o644
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        self._emit(info.tobuf(tarfile.USTAR_FORMAT, tarfile.ENCODING, "surrogateescape"))
        self._last, self._left = name, size

    def write(self, data) -> None:
        n = len(memoryview(data).cast("B"))
        if self._left is None or n > self._left:
            raise CheckpointError(f"more bytes than announced for member {self._last!r}")
        self._emit(data)
        self._left -= n

    def end(self) -> None:
        if self._left != 0:
            raise CheckpointError(f"member {self._last!r} is {self._left} bytes short")
        self._left = None
        pad = -self._offset % tarfile.BLOCKSIZE
        if pad:
            self._emit(tarfile.NUL * pad)

    def add_bytes(self, name: str, data: bytes) -> None:
        self.begin(name, len(data))
        self.write(data)
        self.end()

    def close(self) -> None:
        if self._left is not None:
            raise CheckpointError(f"member {self._last!r} is still open")
        self._emit(tarfile.NUL * (2 * tarfile.BLOCKSIZE))
        pad = -self._offset % tarfile.RECORDSIZE  # tarfile fills the last record with zero blocks
        if pad:
            self._emit(tarfile.NUL * pad)


def unpack(archive: Path, dest: Path, *, skip: frozenset[str] = frozenset()) -> Path:
    """Extract a checkpoint tar into `dest` (created; replaced atomically if it exists), all members but
    those named in `skip` (e.g. the weights, read in place from the archive instead). Owner-only from the
    first byte: files 0600 in a 0700 directory (a new parent 0700 too), so a concurrent look never finds them
    readable by others (the server unpacks while its state directory is private)."""
    dest = Path(dest)
    dest.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=dest.name + ".unpacking-"))  # one per call
    try:
        names = set()
        with tarfile.open(archive, mode="r:") as tar:
            for member in tar:
                if not member.isfile() or not _SAFE_NAME.match(member.name):
                    raise CheckpointError(f"refusing archive member {member.name!r}: not a plain file")
                names.add(member.name)
                if member.name in skip:
                    continue
                src = tar.extractfile(member)
                assert src is not None  # isfile() members always have data
                fd = os.open(tmp / member.name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                with open(fd, "wb") as f:
                    shutil.copyfileobj(src, f)
        if WEIGHTS not in names:
            raise CheckpointError(f"the checkpoint archive has no {WEIGHTS}")
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except (tarfile.TarError, OSError) as exc:
        raise CheckpointError(f"cannot unpack checkpoint {archive}: {exc}") from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def unpack_member(archive: Path, dest: Path, name: str) -> Path:
    """Add one member of the archive to an unpacked directory `dest` (its weights, after an unpack that skipped
    them): written beside it and renamed into place, so a reader of `dest`'s other files never sees it change
    (replacing the whole directory would remove them for a moment under a concurrent reader)."""
    offset, size = members(archive)[name]
    fd, tmp = tempfile.mkstemp(dir=dest, prefix=f".{name}.unpacking-")
    try:
        with open(archive, "rb") as src, open(fd, "wb") as out:
            src.seek(offset)
            left = size
            while left:
                block = src.read(min(left, 1 << 20))
                if not block:
                    raise CheckpointError(f"cannot unpack checkpoint {archive}: {name} is truncated")
                out.write(block)
                left -= len(block)
        os.replace(tmp, dest / name)
    except OSError as exc:
        raise CheckpointError(f"cannot unpack checkpoint {archive}: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest / name


def members(archive: Path) -> dict[str, tuple[int, int]]:
    """name -> (byte offset of its data in the archive file, size), in archive order: a member is read in
    place (`os.pread`) instead of unpacking the archive. Refuses what `unpack` refuses."""
    out = {}
    try:
        with tarfile.open(archive, mode="r:") as tar:
            for member in tar:
                if not member.isfile() or not _SAFE_NAME.match(member.name):
                    raise CheckpointError(f"refusing archive member {member.name!r}: not a plain file")
                out[member.name] = (member.offset_data, member.size)
    except (tarfile.TarError, OSError) as exc:
        raise CheckpointError(f"cannot read checkpoint {archive}: {exc}") from exc
    if WEIGHTS not in out:
        raise CheckpointError(f"the checkpoint archive has no {WEIGHTS}")
    return out


def read_member(archive: Path, span: tuple[int, int]) -> bytes:
    """A (small) member's bytes, `span` as `members` gives it."""
    offset, size = span
    with open(archive, "rb") as f:
        f.seek(offset)
        data = f.read(size)
    if len(data) != size:
        raise CheckpointError(f"{archive}: short read")
    return data


def lineage_bytes(lineage: dict) -> bytes:
    """The lineage manifest file's bytes (sorted keys: the same lineage always packs to the same archive)."""
    return (json.dumps(lineage, indent=2, sort_keys=True) + "\n").encode()


def write_lineage(model_dir: Path, lineage: dict) -> None:
    (Path(model_dir) / LINEAGE).write_bytes(lineage_bytes(lineage))
