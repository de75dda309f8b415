"""Stream the next checkpoint into the blob store tensor by tensor: base in, aggregate added, archive and master out.

Memory grows with one tensor, never with the model (STYLE 17): the base is read in place from its
archive blob with `os.pread`, each aggregated tensor is added as DeltaSoup's sink delivers it, and the
bytes go once, sequentially, to two blobs written and hashed on their own threads: the checkpoint
archive (byte for byte what `archive.pack` writes, so the same content address) and the float32 master
(master_weights.py). The published weights are the master rounded to the base's dtype, so what rounding
drops is carried to the next round. The safetensors data order: the tensors the deltas touch in the
order they are delivered, then the rest in the base's order. Design: docs/design/checkpoint-publishing.md.
"""

from __future__ import annotations

import json
import math
import queue
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import torch

from zoo_gym.proto import archive
from zoo_gym.server.store import master_kernel
from zoo_gym.server.store import master_weights
from zoo_gym.io.read_ahead import ReadAhead
from zoo_gym.io.safetensors_reader import DTYPES, CheckpointFormatError, SafetensorsReader, tensor_bytes

_CHUNK = 16 << 20  # bytes copied at a time for tensors the round does not change
_WRITER_THREADS = 2  # the archive's and the master's (CheckpointWriter)
_QUEUED_PIECES = 4  # pieces (one tensor or one _CHUNK each, <= 64 MiB) waiting per output thread


def _dtype_name(dtype: torch.dtype) -> str:
    return next(k for k, v in DTYPES.items() if v == dtype)


class SafetensorsLayout:
    """The header of a safetensors file whose tensors will be written in `order`, and the checks."""

    def __init__(self, order: Sequence[tuple[str, str, tuple[int, ...]]], *,
                 metadata: Mapping[str, str] | None = None) -> None:
        header: dict = {"__metadata__": dict(metadata)} if metadata else {}
        offset = 0
        self.order = [name for name, _, _ in order]
        self.sizes: dict[str, int] = {}
        data: dict[str, int] = {}
        for name, dtype, shape in order:
            n = DTYPES[dtype].itemsize * math.prod(shape)
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
            self.sizes[name] = n
            data[name] = offset
            offset += n
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # as the safetensors library pads it
        self.header = struct.pack("<Q", len(text)) + text
        self.total = len(self.header) + offset
        self.offsets = {name: len(self.header) + at for name, at in data.items()}  # each tensor's first byte


class _Sequential:
    """Writes a layout's tensors in order to several outputs, checking names and sizes."""

    def __init__(self, layout: SafetensorsLayout, outputs: Sequence[Callable[[memoryview], None]]) -> None:
        self.layout, self._outputs, self._next = layout, outputs, 0
        self._emit(memoryview(layout.header))

    def _emit(self, data) -> None:
        for out in self._outputs:
            out(data)

    def write(self, name: str, data: Iterable) -> None:
        want = self.layout.order[self._next] if self._next < len(self.layout.order) else None
        if name != want:
            raise CheckpointFormatError(f"tensor {name!r} written where {want!r} was due")
        n = 0
        for piece in data:
            self._emit(piece)
            n += len(piece)
        if n != self.layout.sizes[name]:
            raise CheckpointFormatError(f"tensor {name!r}: {n} bytes written, {self.layout.sizes[name]} due")
        self._next += 1

    @property
    def done(self) -> bool:
        return self._next == len(self.layout.order)


class _Background:
    """Calls `outputs` on each piece in one worker thread, in order, with at most `_QUEUED_PIECES`
    waiting. File writes and sha256 updates release the GIL, so the published archive and the master
    are written and hashed on other cores while the caller aggregates the next tensor. A piece is
    held (and so kept alive) until written; an output's error is raised by the next call or `drain`."""

    def __init__(self, outputs: Sequence[Callable[[memoryview], None]], *, name: str) -> None:
        self._outputs = outputs
        self._queue: queue.Queue = queue.Queue(maxsize=_QUEUED_PIECES)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            data = self._queue.get()
            try:
                if data is None:
                    return
                if self._error is None:  # after an error, pieces are only taken off the queue
                    for out in self._outputs:
                        out(data)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                self._error = exc
            finally:
                self._queue.task_done()

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def __call__(self, data) -> None:
        self._raise()
        if not self._thread.is_alive():
            raise CheckpointFormatError("the checkpoint writer is closed")
        self._queue.put(data)

    def drain(self) -> None:
        """Wait until every piece is written; raise what an output raised."""
        self._queue.join()
        self._raise()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


def add_aggregate(kind: str | None, base: torch.Tensor, low: torch.Tensor | None, master: torch.Tensor | None,
                  agg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(published, what the master file stores or None) of `base` (its stored dtype) + `agg` (float32, base's
    shape), a tensor or any slice of one: element by element, so a row block gives the whole tensor's bytes.
    `kind` as `CheckpointWriter._kind`; `low`: the stored low half ("I16", None: none yet); `master`: the float32
    master, a fresh tensor (another kind's, `master_weights.master_of`)."""
    if kind is None:  # float32 (or no master kept): the published weights are the master
        return (base.float() + agg).to(base.dtype), None
    if kind == "I16":  # bf16: one fused pass, in place (master_kernel.py)
        return master_kernel.add_to_bf16_master(base, low, agg.float())
    new_master = master.add_(agg)  # float16: its master is a float32 tensor
    return new_master.to(base.dtype), new_master


class CheckpointWriter:
    """One publish: `sink(name, aggregate)` per changed tensor (DeltaSoup's order), `finish_weights()`,
    then `finish(lineage)`.

    `base_archive` is the base checkpoint's archive blob (read in place); `master` a reader of its
    master file (zoo_gym/server/store/master_weights.py; None: none kept yet, the base is its own master).
    `changed` are the names the aggregation will deliver, in its order. Outputs: `ckpt_blob` (a
    BlobWriter receiving the new checkpoint's archive) and `master_blob` (a BlobWriter receiving the
    new master file; None when the base has no weights below float32, then no master is kept).
    """

    def __init__(self, base_archive: Path, *, master: SafetensorsReader | None, changed: Sequence[str],
                 ckpt_blob: BinaryIO, master_blob: BinaryIO | None, read_ahead: bool = True) -> None:
        self.base_archive = Path(base_archive)
        spans = archive.members(self.base_archive)
        self.base = SafetensorsReader.in_archive(self.base_archive, spans, streamed=True)
        self.master = master
        if master is not None and any(name not in self.base.infos or info.shape != self.base.infos[name].shape
                                      for name, info in master.infos.items()):
            raise CheckpointFormatError("the master's tensors do not match the base's")
        changed_set = set(changed)
        unknown = changed_set - set(self.base.infos)
        if unknown:
            raise CheckpointFormatError(f"the aggregate names {sorted(unknown)[0]!r}, which the base lacks")
        order = list(changed) + [n for n in self.base.names() if n not in changed_set]
        self._changed = changed_set
        infos = self.base.infos
        self.layout = SafetensorsLayout([(n, infos[n].dtype, infos[n].shape) for n in order],
                                        metadata={"format": "pt"})
        self._tar = archive.TarStream(ckpt_blob)
        self._spans = spans
        names = sorted(set(spans) - {archive.LINEAGE} | {archive.WEIGHTS, archive.LINEAGE})
        self._before = [n for n in names if n < archive.WEIGHTS]
        self._after = [n for n in names if n > archive.WEIGHTS]
        for name in self._before:
            self._tar.add_bytes(name, archive.read_member(self.base_archive, spans[name]))
        self._tar.begin(archive.WEIGHTS, self.layout.total)
        # the published bytes and the master's each have their own thread (written and hashed there)
        self._threads = [_Background([self._tar.write], name="publish-weights")]
        self._pub = _Sequential(self.layout, [self._threads[0]])
        self._master_out = None
        self.master_layout: SafetensorsLayout | None = None  # the new master file's (None: no master kept)
        if master_blob is not None:
            m_order = []
            for n in order:
                kind = master_weights.entry_dtype(infos[n].torch_dtype) if n in changed_set else None
                if kind is None and n not in changed_set and master is not None and n in master.infos:
                    kind = master.infos[n].dtype  # untouched: its master is carried over as stored
                if kind is not None:
                    m_order.append((n, kind, infos[n].shape))
            self.master_layout = SafetensorsLayout(m_order, metadata={"format": "pt"})
            self._threads.append(_Background([master_blob.write], name="publish-master"))
            self._master_out = _Sequential(self.master_layout, [self._threads[1]])
        # the next changed tensor's base (and low half) is read while this one is added (zoo_gym/io/read_ahead.py)
        # (read_ahead False: the changed tensors come whole from `put`, computed elsewhere: nothing is read ahead)
        self._inputs = ReadAhead(self._read_inputs, list(changed) if read_ahead else [], size=self._input_bytes)

    def sink(self, name: str, agg: torch.Tensor) -> None:
        """Add the aggregate (numel,) float32 to tensor `name` and write it everywhere."""
        info = self.base.infos[name]
        kind = self._kind(name)
        base, stored_low = self._inputs.get(name)
        master = master_weights.master_of(base, self.master, name) if kind not in (None, "I16") else None
        published, kept = add_aggregate(kind, base, stored_low, master, agg.reshape(info.shape))
        if kept is not None:
            self._master_out.write(name, [tensor_bytes(kept)])
        self._pub.write(name, [tensor_bytes(published)])

    def put(self, name: str, published: Iterable, master: Iterable | None) -> None:
        """Changed tensor `name` computed elsewhere (the Ray engine's blocks, `add_aggregate`): its published
        bytes and, where `sink` would write one, its master entry's, as pieces; written in `sink`'s place."""
        if self._master_out is not None and name in self.master_layout.sizes:
            self._master_out.write(name, master if master is not None else [])
        self._pub.write(name, published)

    @property
    def reads_ahead(self) -> int:
        """Changed tensors whose inputs were read before `sink` asked for them."""
        return self._inputs.read_ahead

    def master_kind(self, name: str) -> str | None:
        """How changed tensor `name`'s master is kept (`_kind`), for a `put` computed elsewhere."""
        return self._kind(name)

    def _kind(self, name: str) -> str | None:
        """How tensor `name`'s master is kept: "I16" (bf16: a low half), another dtype name, None (none)."""
        if self._master_out is None:
            return None
        return master_weights.entry_dtype(self.base.infos[name].torch_dtype)

    def _read_inputs(self, name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Tensor `name` of the base, and its stored low half when its master is kept as one."""
        return self.base.read(name), self._low_half(name) if self._kind(name) == "I16" else None

    def _input_bytes(self, name: str) -> int:
        low = self.master.infos.get(name) if self.master is not None and self._kind(name) == "I16" else None
        return self.base.infos[name].nbytes + (low.nbytes if low is not None else 0)

    def _low_half(self, name: str) -> torch.Tensor | None:
        """Bf16 tensor `name`'s stored low half (None: no master stored, the published weights are it). A
        master an older server stored in float32 is split here: its bf16 rounding is what that server
        published, so the low half joins the base to the same float32 (but at a tie that rounded down,
        one float32 unit below: master_weights.split_low16)."""
        info = self.master.infos.get(name) if self.master is not None else None
        if info is None:
            return None
        stored = self.master.read(name)
        return stored if info.dtype == "I16" else master_weights.split_low16(stored.float())[1]

    def finish_weights(self) -> None:
        """Copy the tensors the round did not change (bytes, a chunk at a time); the weights are complete."""
        for name in self.layout.order[self._pub._next:]:  # noqa: SLF001
            if name in self._changed:
                raise CheckpointFormatError(f"the aggregation never delivered tensor {name!r}")
            self._pub.write(name, self.base.chunks(name))
            if self._master_out is not None and name in self.master_layout.sizes:
                self._master_out.write(name, self.master.chunks(name))
        for t in self._threads:
            t.drain()
        self._tar.end()
        self._inputs.close()
        self.base.close()

    def finish(self, lineage: dict) -> None:
        """Write the lineage and the files after the weights, and close the archive."""
        for name in self._after:
            if name == archive.LINEAGE:
                self._tar.add_bytes(name, archive.lineage_bytes(lineage))
            else:
                self._tar.add_bytes(name, archive.read_member(self.base_archive, self._spans[name]))
        self._tar.close()

    def close(self) -> None:
        self._inputs.close()  # before the files close under a read still running
        for t in self._threads:
            t.close()
        self.base.close()


@contextmanager
def threads_beside_writers() -> Iterator[None]:
    """torch's intra-op threads (and the master kernel's) while a CheckpointWriter streams: the cores its
    two writer threads leave, at least one (OpenMP threads that share a core with a busy writer wait at
    their barriers for the preempted one: docs/design/checkpoint-publishing.md). Global to the process,
    restored on exit."""
    before = torch.get_num_threads()
    torch.set_num_threads(max(1, before - _WRITER_THREADS))
    try:
        yield
    finally:
        torch.set_num_threads(before)


def master_sha256(manifest_json: str | None) -> str | None:
    """The float32 master blob a checkpoint row's lineage names (None: none kept)."""
    try:
        return json.loads(manifest_json or "{}").get("master_sha256")
    except ValueError:
        return None


def master_path(state, checkpoint_sha256: str) -> Path | None:
    """The stored float32 master of a checkpoint, if it has one and its blob is present."""
    from zoo_gym.server.store.models import Checkpoint

    with state.session() as s:
        row = s.get(Checkpoint, checkpoint_sha256)
        sha = master_sha256(row.manifest_json) if row is not None else None
    if sha is None or not state.blobs.exists(sha):
        return None
    return state.blobs.path(sha)
