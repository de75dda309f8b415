"""Tensor-by-tensor reads of a safetensors file, also one stored inside another file, with `os.pread`.

The server reads multi-gigabyte checkpoints without a whole-file map or a whole-model dict: the publish
reads its base in place from the checkpoint archive's blob (server/store/checkpoint_writer.py), the
evaluator reads one decoder layer at a time the same way (evaluation/streamed_model.py). Written here
because `safetensors.safe_open` needs a file of its own: it cannot read the weights member of a tar.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import struct
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from zoo_gym.io.page_cache import drop_cached
from zoo_gym.proto import archive

DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
_CHUNK = 16 << 20  # bytes a time for `chunks`


class CheckpointFormatError(ValueError):
    """A safetensors file is not what its header says."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: str               # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    start: int               # absolute byte offset in the file
    nbytes: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]


class SafetensorsReader:
    """Tensor by tensor reads of a safetensors file with `os.pread` (no whole-file map, no whole-model dict).

    `offset`/`length` read one stored inside another file: a checkpoint archive's weights member is
    read in place (`in_archive`), so the server never needs an unpacked copy to publish from.
    `streamed=True` drops what was read from the page cache (zoo_gym/io/page_cache.py): a publish reads the
    base and its master once, and their pages are better reused by the blobs it writes."""

    def __init__(self, path: Path, *, offset: int = 0, length: int | None = None, streamed: bool = False) -> None:
        self.path = Path(path)
        self._streamed = streamed
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            size = os.fstat(self._fd).st_size - offset if length is None else length
            (n,) = struct.unpack("<Q", os.pread(self._fd, 8, offset))
            if n > min(size - 8, 100 << 20):
                raise CheckpointFormatError(f"{self.path}: header length {n} does not fit the file")
            header = json.loads(os.pread(self._fd, n, offset + 8))
        except (struct.error, ValueError) as exc:
            os.close(self._fd)
            raise CheckpointFormatError(f"{self.path}: not a safetensors file ({exc})") from exc
        self.metadata = header.pop("__metadata__", None) or {}
        infos = {}
        for name, h in header.items():
            b, e = h["data_offsets"]
            if h["dtype"] not in DTYPES or not 0 <= b <= e <= size - 8 - n:
                os.close(self._fd)
                raise CheckpointFormatError(f"{self.path}: tensor {name!r} has dtype {h['dtype']!r} or range "
                                            f"{b}..{e} this reader does not accept")
            infos[name] = TensorInfo(h["dtype"], tuple(h["shape"]), offset + 8 + n + b, e - b)
        # file order: what `load_file` would hand out first
        self.infos: dict[str, TensorInfo] = dict(sorted(infos.items(), key=lambda kv: kv[1].start))

    @classmethod
    def in_archive(cls, path: Path, spans: Mapping[str, tuple[int, int]] | None = None, *,
                   streamed: bool = False) -> "SafetensorsReader":
        """The weights of a checkpoint archive (`archive.members` spans, read if not given), in place."""
        return WeightsFile.in_archive(path, spans).open(streamed=streamed)

    def names(self) -> list[str]:
        return list(self.infos)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {k: v.shape for k, v in self.infos.items()}

    def _checked(self, name: str) -> TensorInfo:
        """Tensor `name`'s entry, once its byte count is the one its shape and dtype need."""
        info = self.infos[name]
        need = math.prod(info.shape) * info.torch_dtype.itemsize
        if need != info.nbytes:
            raise CheckpointFormatError(f"{self.path}: tensor {name!r} holds {info.nbytes} bytes, its shape "
                                        f"{list(info.shape)} of {info.dtype} needs {need}")
        return info

    def read(self, name: str) -> torch.Tensor:
        """One tensor, in its stored dtype and shape (a fresh buffer)."""
        info = self._checked(name)
        out = torch.empty(info.shape, dtype=info.torch_dtype)  # not zero-filled first, as a bytearray is
        if info.nbytes:
            self._read_into(tensor_bytes(out), info.start)
        return out

    def read_as(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """One tensor converted to `dtype` straight from the file's pages (a read-only map, unmapped before
        this returns): no intermediate buffer in the stored dtype, whose fresh pages `read` would fault in.
        The streamed evaluator reads every layer this way, twice per gradient pass."""
        info = self._checked(name)
        n = math.prod(info.shape)
        if not n:
            return torch.empty(info.shape, dtype=dtype)
        mm = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ)
        try:
            with warnings.catch_warnings():  # read-only: the view is only read, into a fresh tensor
                warnings.simplefilter("ignore", UserWarning)
                view = torch.frombuffer(mm, dtype=info.torch_dtype, offset=info.start, count=n)
            out = view.view(info.shape).to(dtype, copy=True)
            del view  # releases the map's exported buffer, so it can close
        finally:
            mm.close()
        if self._streamed:
            drop_cached(self._fd, info.start, info.nbytes)
        return out

    def chunks(self, name: str) -> Iterable[bytes]:
        """The tensor's raw bytes, `_CHUNK` at a time."""
        info = self.infos[name]
        for off in range(0, info.nbytes, _CHUNK):
            n = min(_CHUNK, info.nbytes - off)
            yield os.pread(self._fd, n, info.start + off)
            if self._streamed:
                drop_cached(self._fd, info.start + off, n)

    def _read_into(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise CheckpointFormatError(f"{self.path}: short read")
            done += got
        if self._streamed:
            drop_cached(self._fd, offset, len(view))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous tensor's bytes without a copy (bf16 included: viewed as uint8)."""
    t = t.detach().contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())



@dataclass(frozen=True)
class WeightsFile:
    """Where a checkpoint's safetensors bytes lie: a file of their own, or a span of one (an archive blob)."""
    path: Path
    offset: int = 0
    length: int | None = None

    @classmethod
    def in_archive(cls, path: Path, spans: Mapping[str, tuple[int, int]] | None = None) -> "WeightsFile":
        """The weights member of a checkpoint archive (`archive.members` spans, read if not given)."""
        offset, size = (spans or archive.members(path))[archive.WEIGHTS]
        return cls(Path(path), offset, size)

    def open(self, *, streamed: bool = False) -> SafetensorsReader:
        return SafetensorsReader(self.path, offset=self.offset, length=self.length, streamed=streamed)

    def sha256(self) -> str:
        """sha256 of these bytes: recognises a published checkpoint's weights after its archive round trip."""
        import hashlib

        h = hashlib.sha256()
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            left = self.length if self.length is not None else float("inf")
            while left > 0 and (chunk := f.read(int(min(1 << 20, left)))):
                h.update(chunk)
                left -= len(chunk)
        return h.hexdigest()
