"""Aggregation sharded on Ray (`--aggregation-engine ray`): one task per (tensor, row block).

DeltaSoup validates, clips and plans on the coordinator; `RayPublish` replaces its last pass and a pairwise rule's
distances (tasks return each block's (k, k) part, the coordinator sums them). The new checkpoint's layout (and its
master's) goes into two sparse files under the state directory, which every node mounts at the same path; each task
decodes its rows from the uploads, runs the same Plan code and `pwrite`s its block of the weights and the master.
The coordinator streams both files through the CheckpointWriter, which packs and hashes as the local path does:
every step is element by element, so the bytes are the local engine's for every rule. LoRA means from factors stay
on the coordinator (one matmul). DP noise: the coordinator draws the round's one stream tensor by tensor, as the
local pass does, into a file whose blocks the tasks add. Tasks are idempotent and Ray retries them on a lost worker
or node; one whose node cannot use the state directory ends the round attempt in one line (RayEngineError), nothing
published. Design: docs/design/SCALE-OUT.md (step 2).
"""

from __future__ import annotations

import functools
import math
import mmap
import os
import shutil
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zoo_gym.aggregation.distances import pairwise_sq_distances
from zoo_gym.aggregation.streaming import ClippedRows
from zoo_gym.allocator import settle_allocator
from zoo_gym.io.safetensors_reader import DTYPES, tensor_bytes
from zoo_gym.server.rounds.faults import task_gate
from zoo_gym.server.rounds.stored_deltas import StoredDeltas
from zoo_gym.server.store import master_weights
from zoo_gym.server.store.checkpoint_writer import add_aggregate

_TASK_RETRIES = 4  # a task lost with its worker or node is run again (idempotent: the same bytes, same place)
_BYTES_PER_ELEMENT = 16  # per contributor: the float32 rows plus a sort's values and int64 order (trimmed mean)
_CHUNK = 16 << 20


class RayEngineError(RuntimeError):
    """Ray is missing or unreachable, or a task would not fit its memory: one line saying what to do."""


def connect(address: str | None) -> None:
    """Join the Ray cluster at `address` (None: start a local one) once per process; RayEngineError if not."""
    try:
        import ray
    except ImportError:
        raise RayEngineError("`aggregation_engine` ray needs Ray, which is not installed: "
                             "pip install 'zoo-gym[ray]'") from None
    if ray.is_initialized():
        return
    _probe(address)
    extra: dict[str, Any] = {"include_dashboard": False} if address is None else {}
    try:
        # "local": a new local instance, never whatever cluster this machine started last (/tmp/ray's record)
        ray.init(address=address or "local", log_to_driver=False, **extra)
    except Exception as exc:  # noqa: BLE001 - ConnectionError, ValueError, RuntimeError: said in one line
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise RayEngineError(f"cannot join the Ray cluster at {address or 'a new local one'}: {first}") from None


def _probe(address: str | None, timeout: float = 10.0) -> None:
    """A host:port address must answer a TCP connection first: Ray's own client retries a dead one for minutes."""
    if address is None or "://" in address or address == "auto":
        return
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=timeout).close()
    except (OSError, ValueError) as exc:
        raise RayEngineError(f"cannot join the Ray cluster at {address}: {exc} (is `ray start --head` running "
                             "there? --ray-address takes the head's host:port)") from None


@dataclass(frozen=True)
class RowFiles:
    """What a distance task needs to read its rows, by path (every node mounts the state directory at the same
    place)."""

    payloads: list[str]                       # upload blobs, in the source's contributor order
    contributors: list[str]
    shapes: dict[str, tuple[int, ...]]        # the changed tensors
    acc: torch.Tensor                         # (k,) accepted rows
    factors: torch.Tensor                     # (k,) clip factors
    n: int
    flush: Any                                # async_rounds.SyncFlush | StalenessFlush: rows and step as recorded


@dataclass(frozen=True)
class RoundFiles(RowFiles):
    """What a last-pass task needs: its rows' files and the checkpoint's, by path."""

    d_total: int                              # the changed tensors' elements: shares are block / d_total
    base: str                                 # the base checkpoint's archive
    base_at: dict[str, tuple[str, int]]       # name -> (dtype, first byte in `base`)
    master: str | None                        # the base's master file (None: none stored)
    master_at: dict[str, tuple[str, int]]     # name -> (stored dtype, first byte in `master`)
    kinds: dict[str, str | None]              # CheckpointWriter._kind of each changed tensor
    out: str                                  # the new weights' layout file
    out_at: dict[str, int]
    out_master: str | None                    # the new master's layout file
    out_master_at: dict[str, int]
    noise: str | None = None                  # the DP noise of every noised tensor, float32 (None: DP off)
    noise_at: dict[str, int] | None = None    # name -> first byte of its noise in `noise`


def _pread(path: str, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty(count, dtype=dtype)
    view, done = tensor_bytes(out), 0
    fd = os.open(path, os.O_RDONLY)
    try:
        while done < len(view):
            got = os.preadv(fd, [view[done:]], offset + done)
            if got <= 0:
                raise RayEngineError(f"{path}: short read at byte {offset + done}")
            done += got
    finally:
        os.close(fd)
    return out


def _pwrite(path: str, offset: int, t: torch.Tensor) -> None:
    view, done = tensor_bytes(t), 0
    fd = os.open(path, os.O_WRONLY)
    try:
        while done < len(view):
            done += os.pwrite(fd, view[done:], offset + done)
    finally:
        os.close(fd)


def write_block(files: RoundFiles, name: str, start: int, stop: int, agg: torch.Tensor) -> None:
    """Elements [start, stop) of tensor `name`: base (+ stored master) + `agg` ((stop - start,) float32), written
    into the layout files as CheckpointWriter.sink writes the whole tensor (`add_aggregate`)."""
    dtype_name, first = files.base_at[name]
    dtype, kind = DTYPES[dtype_name], files.kinds[name]
    base = _pread(files.base, first + start * dtype.itemsize, stop - start, dtype)
    stored = files.master_at.get(name) if files.master is not None else None
    raw = None
    if stored is not None and kind is not None:
        sdt = DTYPES[stored[0]]
        raw = _pread(files.master, stored[1] + start * sdt.itemsize, stop - start, sdt)
    low = master = None
    if kind == "I16" and raw is not None:  # as CheckpointWriter._low_half
        low = raw if stored[0] == "I16" else master_weights.split_low16(raw.float())[1]
    elif kind not in (None, "I16"):  # as master_weights.master_of
        master = (base.float() if base.dtype != torch.float32 else base.clone()) if raw is None else (
            master_weights.join_low16(base, raw) if stored[0] == "I16" else raw.float())
    published, kept = add_aggregate(kind, base, low, master, agg)
    _pwrite(files.out, files.out_at[name] + start * dtype.itemsize, published)
    if kept is not None:
        _pwrite(files.out_master, files.out_master_at[name] + start * kept.element_size(), kept)


class _Block:
    """DeltaSource of one tensor's elements [start, stop) (zoo_gym.aggregation.DeltaSource)."""

    def __init__(self, stored: StoredDeltas, name: str, start: int, stop: int) -> None:
        self._stored, self._name, self._start, self._stop = stored, name, start, stop
        self.contributors = stored.contributors

    def names(self) -> list[str]:
        return [self._name]

    def shape(self, name: str) -> tuple[int, ...]:
        return (self._stop - self._start,)

    def stacked(self, name: str) -> torch.Tensor:
        return self._stored.stacked_block(name, self._start, self._stop)

    def packed(self, name: str) -> None:
        return None


_OPEN: dict[tuple[str, ...], StoredDeltas] = {}  # per worker process: the round it last served


def _stored(files: RoundFiles) -> StoredDeltas:
    key = tuple(files.payloads)
    if key not in _OPEN:
        _OPEN.clear()  # the maps of an earlier round close with their StoredDeltas
        maps = []
        for p in files.payloads:
            with open(p, "rb") as f:
                maps.append(mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ))
        _OPEN[key] = StoredDeltas(maps, files.contributors, files.shapes, cache_bytes=0)
    return _OPEN[key]


class NodeStorageError(RuntimeError):
    """A task's node could not read the round's inputs or write its outputs: one line naming the node and path."""


def run_block(files: RoundFiles, plan, name: str, start: int, stop: int):
    """One task: the rule's aggregate of elements [start, stop) of tensor `name`, as DeltaSoup's last pass computes
    it (clipped rows, the recorded step), written in place. Returns the plan copy (its diagnostics)."""
    task_gate(f"{name}@{start}")  # tests only: a known step to kill or break things at (faults.py)
    _settled()  # a worker process gives back what a task freed, as gym-server does
    try:
        agg = plan.aggregate(_block_rows(files, name, start, stop),
                             share=(stop - start) / files.d_total if files.d_total else 0.0)
        if files.noise is not None:  # as Release.noise: the aggregate plus the noise drawn for these elements
            agg = agg + _pread(files.noise, files.noise_at[name] + 4 * start, stop - start, torch.float32)
        write_block(files, name, start, stop, _stepped(files.flush, name, agg))
    except OSError as exc:  # the state directory not mounted here, or not readable: said by the coordinator
        raise NodeStorageError(f"node {_node()}: {exc}") from None
    return plan


def block_distances(files: RowFiles, name: str, start: int, stop: int) -> torch.Tensor:
    """One task of a pairwise rule's first pass: the (k, k) float64 squared distances of elements [start, stop) of
    tensor `name` between the clipped accepted rows; the coordinator sums them over every block of every tensor."""
    task_gate(f"distances:{name}@{start}")  # tests only, as run_block's: before this worker maps any upload
    _settled()
    try:
        return pairwise_sq_distances(_block_rows(files, name, start, stop))
    except OSError as exc:
        raise NodeStorageError(f"node {_node()}: {exc}") from None


def _block_rows(files: RowFiles | RoundFiles, name: str, start: int, stop: int) -> torch.Tensor:
    """(k, stop - start) the accepted rows of elements [start, stop) of `name`, clipped and weighted as the round
    recorded them (ClippedRows over the stored uploads: what DeltaSoup's passes read)."""
    source, _ = files.flush.rows(_Block(_stored(files), name, start, stop), files.contributors, None)
    return ClippedRows(source, [name], files.acc, files.factors, files.n).rows(name)


def _node() -> str:
    """This host's name and the Ray node's IP, for the lines that name a node."""
    try:
        import ray

        return f"{socket.gethostname()} ({ray.util.get_node_ip_address()})"
    except Exception:  # noqa: BLE001 - a name is enough
        return socket.gethostname()


def _stepped(flush, name: str, agg: torch.Tensor) -> torch.Tensor:
    """The aggregate as the writer's sink receives it: float32, times the recorded step (flush.sink)."""
    got: list[torch.Tensor] = []
    flush.sink(lambda _name, a: got.append(a))(name, agg.to(torch.float32))
    return got[0]


@functools.cache
def _settled() -> bool:
    return settle_allocator()


@functools.cache
def _remote(task=run_block):
    import ray

    return ray.remote(max_retries=_TASK_RETRIES)(task)


def blocks(shape: tuple[int, ...], block_rows: int) -> Iterator[tuple[int, int]]:
    """[start, stop) element ranges of `block_rows` rows each (a row: the elements past the first dimension)."""
    numel = math.prod(shape)
    width = numel // shape[0] if shape and shape[0] else 1
    step = max(1, block_rows * width)
    for start in range(0, numel, step):
        yield start, min(numel, start + step)


def task_bytes(shape: tuple[int, ...], rows: int, k: int) -> int:
    """Memory one task takes: `rows` rows x (k contributors' working copies + base, output and master, and one
    contributor's rows as decoded: every codec decodes a block of whole rows from those rows alone, StoredDeltas.
    _decode_rows), plus one whole decoded tensor where a block may not be decoded alone: a 1-D tensor, or an
    odd row width (int4's two codes a byte)."""
    width = math.prod(shape) // shape[0] if shape and shape[0] else 1
    whole = 4 * math.prod(shape) if len(shape) < 2 or width % 2 else 0
    return rows * width * (k * _BYTES_PER_ELEMENT + 20) + whole


def check_memory(shapes: dict[str, tuple[int, ...]], k: int, *, block_rows: int, budget_mb: int) -> None:
    """RayEngineError naming the first tensor whose task would need more than `budget_mb` and the rows that fit."""
    budget = budget_mb << 20
    for name, shape in shapes.items():
        rows = min(block_rows, shape[0] if shape else 1)
        need = task_bytes(shape, rows, k)
        if need <= budget:
            continue
        fit = next((r for r in (rows // 2 ** i for i in range(1, 64)) if r and task_bytes(shape, r, k) <= budget), 0)
        advice = (f"lower --ray-block-rows to {fit}" if fit else
                  f"even one row does not fit ({task_bytes(shape, 1, k) >> 20} MiB): raise --ray-task-memory-mb")
        raise RayEngineError(f"tensor {name} {list(shape)}: a task of {rows} rows x {k} contributors needs "
                             f"{need >> 20} MiB, over --ray-task-memory-mb {budget_mb}: {advice}")


class RayPublish:
    """DeltaSoup.run's `publish=`: the last pass as Ray tasks, its results put into `writer` (see the module).
    `payloads`: the upload blobs in the source's order; `tap`: the server's source (a SlopeTap when scoring),
    which sees each tensor as the local pass would show it; `work`: an empty directory under the state dir."""

    def __init__(self, writer, *, payloads: list[Path], contributors: list[str], flush, tap, work: Path,
                 address: str | None, block_rows: int, task_memory_mb: int) -> None:
        self.writer, self.payloads, self.contributors, self.flush, self.tap = writer, payloads, contributors, flush, tap
        self.work, self.address, self.block_rows, self.task_memory_mb = work, address, block_rows, task_memory_mb
        self.tasks = 0

    def __call__(self, plan, rows: ClippedRows, release, numels: dict[str, int]) -> None:
        shapes = {name: tuple(self.writer.base.infos[name].shape) for name in rows.names}
        check_memory(shapes, int(rows.acc.numel()), block_rows=self.block_rows, budget_mb=self.task_memory_mb)
        connect(self.address)
        import ray

        files = self._files(rows, shapes, sum(numels.values()), noised=release.dp.enabled)
        try:
            pristine, files_ref = ray.put(plan), ray.put(files)  # serialized now: before any block is aggregated
            refs = []
            for name in rows.names:
                agg = plan.from_factors(rows.source, name, rows.acc, rows.factors, out=torch.empty(numels[name]))
                if agg is not None:  # LoRA mean from factors: one matmul here, written as a block would be
                    write_block(files, name, 0, numels[name], _stepped(self.flush, name, agg))
                    continue
                self._show_tap(name)
                if files.noise is not None:  # drawn before its blocks run, in the local pass's order
                    _pwrite(files.noise, files.noise_at[name], release.draw((numels[name],), dtype=torch.float32))
                refs += [_remote().remote(files_ref, pristine, name, a, b) for a, b in blocks(shapes[name],
                                                                                               self.block_rows)]
            self.tasks = len(refs)
            for part in _results(refs):  # in (tensor, block) order: a redo sums the same diagnostics
                plan.absorb(part)
            for name in rows.names:
                self.writer.put(name, _chunks(files.out, files.out_at[name], self.writer.layout.sizes[name]),
                                self._master_chunks(files, name))
        finally:
            shutil.rmtree(self.work, ignore_errors=True)

    def pairwise_sq_distances(self, rows: ClippedRows) -> torch.Tensor:
        """DeltaSoup.run's `distances=`: a pairwise rule's (k, k) whole-model squared distances as Ray tasks, one
        per (tensor, row block), summed here in (tensor, block) order (a redo sums the same numbers); the chosen rows
        are then averaged by the last pass's tasks. The coordinator holds (k, k), never a tensor x contributors."""
        shapes = {name: tuple(self.writer.base.infos[name].shape) for name in rows.names}
        check_memory(shapes, int(rows.acc.numel()), block_rows=self.block_rows, budget_mb=self.task_memory_mb)
        connect(self.address)
        import ray

        files = ray.put(RowFiles(payloads=[str(p) for p in self.payloads], contributors=list(self.contributors),
                                 shapes=shapes, acc=rows.acc, factors=rows.factors, n=rows.n, flush=self.flush))
        refs = [_remote(block_distances).remote(files, name, a, b) for name in rows.names
                for a, b in blocks(shapes[name], self.block_rows)]
        k = int(rows.acc.numel())
        total = torch.zeros((k, k), dtype=torch.float64)
        for part in _results(refs):
            total += part
        return total

    def _show_tap(self, name: str) -> None:
        """Scoring's SlopeTap takes its slopes from the first rows it sees of a tensor: those the local last pass
        would decode here (LoRA tensors validated from their factors), in the same order."""
        seen = getattr(self.tap, "seen", None)
        if seen is not None and not seen(name):
            self.tap.stacked(name)

    def _master_chunks(self, files: RoundFiles, name: str):
        m = self.writer.master_layout
        if files.out_master is None or m is None or name not in m.sizes:
            return None
        return _chunks(files.out_master, files.out_master_at[name], m.sizes[name])

    def _files(self, rows: ClippedRows, shapes: dict[str, tuple[int, ...]], d_total: int, *,
               noised: bool) -> RoundFiles:
        """The layout files (headers written, sparse otherwise), the noise file when `noised`, and what tasks read,
        by path."""
        w = self.writer
        shutil.rmtree(self.work, ignore_errors=True)  # a crashed attempt's files
        self.work.mkdir(parents=True)
        out = _layout_file(self.work / "weights.safetensors", w.layout)
        m_layout = w.master_layout
        out_master = _layout_file(self.work / "master.safetensors", m_layout) if m_layout is not None else None
        master = w.master
        return RoundFiles(
            payloads=[str(p) for p in self.payloads], contributors=list(self.contributors), shapes=shapes,
            acc=rows.acc, factors=rows.factors, n=rows.n, d_total=d_total, flush=self.flush,
            base=str(w.base_archive), base_at={n: (w.base.infos[n].dtype, w.base.infos[n].start) for n in shapes},
            master=str(master.path) if master is not None else None,
            master_at={n: (i.dtype, i.start) for n, i in master.infos.items() if n in shapes} if master else {},
            kinds={n: w.master_kind(n) for n in shapes},
            out=out, out_at=w.layout.offsets, out_master=out_master,
            out_master_at=m_layout.offsets if m_layout is not None else {}, **self._noise_file(shapes, noised))

    def _noise_file(self, shapes: dict[str, tuple[int, ...]], noised: bool) -> dict:
        """A sparse float32 file with room for every changed tensor's noise (written tensor by tensor)."""
        if not noised:
            return {}
        at, total = {}, 0
        for name, shape in shapes.items():
            at[name], total = total, total + 4 * math.prod(shape)
        path = self.work / "noise.f32"
        with open(path, "wb") as f:
            f.truncate(total)
        return {"noise": str(path), "noise_at": at}


def _results(refs: list) -> list:
    """The tasks' results in order. A task that raised (a lost worker or node is not that: Ray reruns its tasks)
    ends the round with one RayEngineError line once the other tasks have ended (waited for, at most a minute).
    They are not cancelled: `ray.cancel` racing a task's completion crashes the driver, the server, in Ray 2.55
    ("Check failed: it != submissible_tasks_.end()", ray-project/ray#54846; CHANGELOG)."""
    import ray

    try:
        return ray.get(refs)
    except ray.exceptions.RayTaskError as exc:
        ray.wait(refs, num_returns=len(refs), timeout=60)  # ended (bounded): the caller then removes their files
        cause = getattr(exc, "cause", None) or exc
        first = (str(cause).strip().splitlines() or [type(cause).__name__])[0]
        if isinstance(cause, NodeStorageError):
            raise RayEngineError(f"a Ray task could not use the state directory on {first} (every node must mount "
                                 "it at the same path, readable and writable); the round is not published") from None
        raise RayEngineError(f"a Ray task failed: {type(cause).__name__}: {first}; the round is not published") from None


def _layout_file(path: Path, layout) -> str:
    """A file of the layout's size holding its header; the tensors' bytes are written by the tasks."""
    with open(path, "wb") as f:
        f.write(layout.header)
        f.truncate(layout.total)
    return str(path)


def _chunks(path: str, offset: int, size: int) -> Iterator[bytes]:
    fd = os.open(path, os.O_RDONLY)
    try:
        for at in range(0, size, _CHUNK):
            yield os.pread(fd, min(_CHUNK, size - at), offset + at)
    finally:
        os.close(fd)
