"""Streamed blobs (a published checkpoint's master) bypass the page cache with O_DIRECT: the bytes
on disk and the content address must be exactly what was written, across buffer boundaries, unaligned
pieces, a flush in the middle, and file systems that refuse O_DIRECT. Cached blobs (a published checkpoint)
hand their pages to writeback as they go, with the same bytes."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
import torch

from zoo_gym.io import direct_writes, page_cache
from zoo_gym.io.direct_writes import DirectWriter
from zoo_gym.server.store.blobs import BlobStore
from zoo_gym.io.safetensors_reader import tensor_bytes


def _pieces(seed: int) -> list[bytes]:
    """Pieces of awkward sizes: empty, a few bytes, a tar header, just past a buffer, several buffers."""
    g = torch.Generator().manual_seed(seed)
    sizes = [0, 3, 512, direct_writes.BUFFER + 1, 4095, 3 * direct_writes.BUFFER - 7, 1, 100_000]
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).numpy().tobytes() for n in sizes]


@pytest.fixture
def small_buffers(monkeypatch):
    monkeypatch.setattr(direct_writes, "BUFFER", 64 << 10)  # many hand-overs in a small test


def test_direct_writer_writes_exactly_the_bytes_given(tmp_path: Path, small_buffers) -> None:
    path = tmp_path / "out.bin"
    w = DirectWriter(os.open(path, os.O_WRONLY | os.O_CREAT))
    if not w.direct:
        pytest.skip(f"{tmp_path} refuses O_DIRECT; the fallback is tested below")
    pieces = _pieces(0)
    for p in pieces:
        w.write(p)
    assert w.direct  # nothing forced it off before the end
    w.finish()
    w.close()
    assert path.read_bytes() == b"".join(pieces)


def test_flush_in_the_middle_makes_bytes_readable_and_writing_goes_on(tmp_path: Path, small_buffers) -> None:
    path = tmp_path / "out.bin"
    w = DirectWriter(os.open(path, os.O_WRONLY | os.O_CREAT))
    first, second = _pieces(1), _pieces(2)
    for p in first:
        w.write(p)
    w.flush()
    assert path.read_bytes() == b"".join(first)  # readable through the path, as BlobWriter.flush promises
    for p in second:
        w.write(p)
    w.finish()
    w.close()
    assert path.read_bytes() == b"".join(first + second)


@pytest.mark.parametrize("o_direct", ["accepted", "refused"])
def test_streamed_blob_has_the_same_content_and_address_as_a_plain_one(tmp_path: Path, o_direct: str,
                                                                       small_buffers, monkeypatch) -> None:
    if o_direct == "refused":  # as on a file system without direct I/O (open fails with EINVAL)
        monkeypatch.setattr(direct_writes, "try_direct", lambda fd: False)
    store = BlobStore(tmp_path / "blobs")
    t = torch.randn(300_001, dtype=torch.float32).to(torch.bfloat16)  # an odd-sized tensor, as published
    pieces = _pieces(3) + [bytes(tensor_bytes(t))]
    want = hashlib.sha256(b"".join(pieces)).hexdigest()
    with store.writer(streamed=True) as w:
        if o_direct == "refused":
            assert not w._file.direct  # noqa: SLF001 - the page-cache path runs
        for p in pieces:
            w.write(memoryview(p))
        digest = w.commit()
    assert digest == want
    assert store.path(digest).read_bytes() == b"".join(pieces)
    assert list(store.tmp_dir.iterdir()) == []  # nothing left behind


def test_a_cached_blob_is_handed_to_writeback_as_it_goes_and_keeps_its_bytes(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(page_cache, "DROP_STEP", 256 << 10)  # several hand-overs in a small blob
    handed: list[tuple[int, int]] = []
    real = page_cache.start_writeback
    monkeypatch.setattr(page_cache, "start_writeback", lambda fd, off, n: (handed.append((off, n)), real(fd, off, n)))
    store = BlobStore(tmp_path / "blobs")
    pieces = _pieces(4)  # with the 3-byte and empty pieces still in Python's buffer when a step is due
    with store.writer() as w:
        for p in pieces:
            w.write(memoryview(p))
        digest = w.commit()
    data = b"".join(pieces)
    assert digest == hashlib.sha256(data).hexdigest()
    assert store.path(digest).read_bytes() == data
    assert len(handed) >= 2 and handed[0][0] == 0  # front to back, each range where the last one ended
    assert all(a + n == b for (a, n), (b, _) in zip(handed, handed[1:]))
    assert len(data) - page_cache.DROP_STEP <= handed[-1][0] + handed[-1][1] <= len(data)  # the fsync does the rest


def test_a_discarded_streamed_blob_leaves_nothing(tmp_path: Path, small_buffers) -> None:
    store = BlobStore(tmp_path / "blobs")
    with store.writer(streamed=True) as w:
        for p in _pieces(4):
            w.write(p)
    assert list(store.tmp_dir.iterdir()) == []
    assert list((store.root / "sha256").iterdir()) == []


_FULL_DISK_SCRIPT = """
import errno, os, resource, signal, sys
from pathlib import Path
from zoo_gym.io import direct_writes
from zoo_gym.server.store.blobs import BlobStore
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG, as ENOSPC on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (direct_writes.BUFFER + 4096, resource.RLIM_INFINITY))
store = BlobStore(Path(sys.argv[1]))
try:
    with store.writer(streamed=True) as w:
        for _ in range(4):
            w.write(b"x" * direct_writes.BUFFER)
        w.commit()
except OSError as exc:
    print("ERRNO", exc.errno)
print("TMP", len(list(store.tmp_dir.iterdir())), "BLOBS", len(list((store.root / "sha256").iterdir())))
"""


def test_a_streamed_blob_on_a_full_disk_fails_with_the_os_error_and_leaves_nothing(tmp_path: Path) -> None:
    """The failed write's error reaches the caller as itself (no BufferError from closing the buffers the
    failed write still held), and the temporary file is removed."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _FULL_DISK_SCRIPT, str(tmp_path / "blobs")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "ERRNO 27" in out.stdout  # EFBIG
    assert "TMP 0 BLOBS 0" in out.stdout


def test_queued_writes_keep_the_order_bound_what_waits_and_surface_a_failure(tmp_path):
    """QueuedWrites writes on its own thread in the order handed over, never lets more than `max_bytes` wait
    (one piece may exceed it alone), and a failed write is raised in the caller's thread, not lost."""
    import threading

    from zoo_gym.io.direct_writes import QueuedWrites

    path = tmp_path / "f"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    writer = DirectWriter(fd)
    release, waiting = threading.Event(), []
    write = writer.write

    def slow(data):
        release.wait(5)
        write(data)

    writer.write = slow
    queued = QueuedWrites(writer, max_bytes=3000)
    pieces = [bytes([i]) * 1000 for i in range(6)]
    for p in pieces[:3]:
        queued.write(memoryview(p))
        waiting.append(queued._queued)  # noqa: SLF001
    blocked = threading.Thread(target=queued.write, args=(memoryview(pieces[3]),))
    blocked.start()
    blocked.join(0.3)
    assert blocked.is_alive() and max(waiting) <= 3000  # the fourth waits for room
    release.set()
    blocked.join(5)
    for p in pieces[4:]:
        queued.write(memoryview(p))
    queued.drain()
    writer.finish()
    writer.close()
    assert path.read_bytes() == b"".join(pieces)

    fd = os.open(tmp_path / "g", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    failing = DirectWriter(fd)
    failing.write = lambda data: (_ for _ in ()).throw(OSError(28, "No space left on device"))
    queued = QueuedWrites(failing, max_bytes=10)
    queued.write(memoryview(b"x" * 5))
    with pytest.raises(OSError, match="No space left"):
        queued.drain()
    with pytest.raises(OSError, match="No space left"):
        queued.write(memoryview(b"y"))
    failing.close()
