"""The payload container: an explicit binary format, never pickle (integers little-endian).

    0 magic b"ZGDELTA\\x00" | 8 format version u16 (1) | 10 flags u16 (0) | 12 header length u32
    16 header crc32 u32 (zlib.crc32) | 20 UTF-8 JSON header {"body_size", "metadata", "entries": [...]},
    zero-padded to a multiple of 64 bytes | body_start: body_size bytes, where the payload ends

Each entry declares name, shape, dtype, codec, group_size, scale_dtype and the byte range
``[offset, offset + nbytes)`` of its data from ``body_start``; a ``lora`` entry declares rank and factor
entries ``A`` (r, in) and ``B`` (out, r). Every field is checked for type, range and consistency before
anything is allocated. Layout and reasons: docs/design/codec.md.
"""

from __future__ import annotations

import json
import math
import struct
import zlib
from dataclasses import dataclass, field
from typing import Any

from zoo_gym.codec.errors import CodecError
from zoo_gym.codec.layout import (
    DENSE_CODECS,
    DTYPES,
    PASSTHROUGH_CODECS,
    SCALE_DTYPES,
    align,
    groups_for,
    leaf_nbytes,
    view_2d,
)

__all__ = [
    "MAGIC",
    "FORMAT_VERSION",
    "TensorEntry",
    "Manifest",
    "as_buffer",
    "build_payload",
    "parse_manifest",
]

MAGIC = b"ZGDELTA\x00"
FORMAT_VERSION = 1
_PREFIX = struct.Struct("<8sHHII")  # magic, version, flags, header length, header crc32
BODY_ALIGN = 64  # bytes
MAX_HEADER_BYTES = 64 << 20
MAX_ENTRIES = 1 << 20
MAX_NAME_CHARS = 1024
MAX_NDIM = 8
MAX_DIM = 1 << 40
MAX_METADATA_BYTES = 1 << 20
_LEAF_KEYS = frozenset({"name", "shape", "dtype", "codec", "group_size", "scale_dtype", "offset", "nbytes"})
_LORA_KEYS = frozenset({"name", "shape", "dtype", "codec", "rank", "offset", "nbytes", "factors"})


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of a payload as the header declares it (validated)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # "float32" | "bfloat16" | "float16": the dtype decode returns
    codec: str  # the codec actually used: bitdelta|int8|int4|fp16|bf16|fp32|lora
    group_size: int | None  # as requested: >0 groups of G, None per row, -1 per tensor (None for passthrough)
    offset: int  # absolute byte offset of the data in the payload
    nbytes: int  # bytes of data (for lora: the span of both factors)
    rank: int | None = None  # lora only
    scale_dtype: str | None = None  # bitdelta/int8/int4 only
    factors: tuple[TensorEntry, ...] = field(default=())  # lora only: (A, B)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Manifest:
    """The validated header of a payload."""

    entries: list[TensorEntry]
    metadata: dict[str, Any]
    payload_size: int  # bytes of the whole payload
    format_version: int
    body_offset: int  # where the body starts in the payload

    @property
    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def entry(self, name: str) -> TensorEntry:
        for e in self.entries:
            if e.name == name:
                return e
        raise CodecError(f"payload has no tensor named {name!r}; it holds {len(self.entries)} tensors")


def as_buffer(payload: Any) -> memoryview:
    """A flat byte view of bytes, bytearray, memoryview or mmap, without copying."""
    try:
        mv = memoryview(payload)
    except TypeError as e:
        raise CodecError(f"payload must be bytes, bytearray, memoryview or mmap, got {type(payload).__name__}") from e
    if mv.ndim != 1 or mv.format != "B":
        if not mv.c_contiguous:
            raise CodecError("payload buffer must be C-contiguous")
        mv = mv.cast("B")
    return mv


def build_payload(*, entries: list[dict[str, Any]], metadata: dict[str, Any], body: list[Any], body_size: int) -> bytes:
    """Assemble prefix, header and body chunks (buffers) into one payload."""
    if sum(memoryview(c).nbytes for c in body) != body_size:
        raise AssertionError("encoder bug: body chunks do not add up to the declared body_size")
    header = {"body_size": body_size, "metadata": metadata, "entries": entries}
    try:
        hb = json.dumps(header, separators=(",", ":"), allow_nan=False, ensure_ascii=False).encode("utf-8")
    except (TypeError, ValueError) as e:
        raise CodecError(f"`metadata` must be a JSON-able dict of finite numbers, strings, lists and dicts: {e}") from e
    if len(hb) > MAX_HEADER_BYTES:
        raise CodecError(f"header of {len(hb)} bytes exceeds {MAX_HEADER_BYTES}; send fewer tensors or less metadata")
    prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, 0, len(hb), zlib.crc32(hb))
    head_len = _PREFIX.size + len(hb)
    pad = bytes(align(head_len, to=BODY_ALIGN) - head_len)
    return b"".join([prefix, hb, pad, *body])


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        raise CodecError("header JSON has a duplicated key")
    return d


def _reject_constant(name: str) -> Any:
    raise CodecError(f"header JSON holds the non-finite number {name}")


def _int(d: dict, key: str, *, where: str, lo: int, hi: int) -> int:
    v = d[key]
    if type(v) is not int or not lo <= v <= hi:
        raise CodecError(f"{where}: `{key}` must be an int in [{lo}, {hi}], got {v!r}")
    return v


def _leaf(d: Any, *, where: str, base: int, body_size: int, max_elements: int) -> TensorEntry:
    if not isinstance(d, dict) or set(d) != _LEAF_KEYS:
        got = sorted(d) if isinstance(d, dict) else type(d).__name__
        raise CodecError(f"{where}: expected keys {sorted(_LEAF_KEYS)}, got {got}")
    name = d["name"]
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
        raise CodecError(f"{where}: `name` must be a non-empty string of at most {MAX_NAME_CHARS} chars")
    where = f"{where} ({name!r})"
    shape = d["shape"]
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise CodecError(f"{where}: `shape` must be a list of at most {MAX_NDIM} ints")
    if any(type(s) is not int or not 0 < s <= MAX_DIM for s in shape):
        raise CodecError(f"{where}: `shape` entries must be ints in [1, {MAX_DIM}], got {shape}")
    shape_t = tuple(shape)
    if math.prod(shape_t) > max_elements:
        raise CodecError(f"{where}: {math.prod(shape_t)} elements exceed max_elements={max_elements}")
    dtype, codec, scale_dtype, gs = d["dtype"], d["codec"], d["scale_dtype"], d["group_size"]
    if dtype not in DTYPES:
        raise CodecError(f"{where}: unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}")
    if codec not in DENSE_CODECS:
        raise CodecError(f"{where}: unknown codec {codec!r}; expected one of {DENSE_CODECS}")
    if codec in PASSTHROUGH_CODECS:
        if gs is not None or scale_dtype is not None:
            raise CodecError(f"{where}: codec {codec} takes no `group_size` or `scale_dtype`")
    else:
        if scale_dtype not in SCALE_DTYPES:
            raise CodecError(f"{where}: `scale_dtype` must be one of {sorted(SCALE_DTYPES)}, got {scale_dtype!r}")
        if not (gs is None or gs == -1 or (type(gs) is int and 0 < gs <= MAX_DIM)):
            raise CodecError(f"{where}: `group_size` must be None, -1 or an int in [1, {MAX_DIM}], got {gs!r}")
        rows, cols = view_2d(shape_t)
        try:
            groups_for(rows=rows, cols=cols, group_size=gs, codec=codec)
        except CodecError as e:
            raise CodecError(f"{where}: {e}") from None
    offset = _int(d, "offset", where=where, lo=0, hi=body_size)
    want = leaf_nbytes(codec=codec, shape=shape_t, group_size=gs, scale_dtype=scale_dtype)
    nbytes = _int(d, "nbytes", where=where, lo=0, hi=body_size)
    if nbytes != want:
        raise CodecError(f"{where}: `nbytes` is {nbytes} but shape {shape_t} under {codec} needs {want}")
    if offset + nbytes > body_size:
        raise CodecError(f"{where}: bytes [{offset}, {offset + nbytes}) run past the body of {body_size} bytes")
    return TensorEntry(name, shape_t, dtype, codec, gs, base + offset, nbytes, None, scale_dtype)


def _lora(d: dict, *, where: str, base: int, body_size: int, max_elements: int) -> TensorEntry:
    if set(d) != _LORA_KEYS:
        raise CodecError(f"{where}: a lora entry needs keys {sorted(_LORA_KEYS)}, got {sorted(d)}")
    name = d["name"]
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
        raise CodecError(f"{where}: `name` must be a non-empty string of at most {MAX_NAME_CHARS} chars")
    where = f"{where} ({name!r})"
    shape = d["shape"]
    if not isinstance(shape, list) or len(shape) != 2 or any(type(s) is not int or not 0 < s <= MAX_DIM for s in shape):
        raise CodecError(f"{where}: a lora `shape` must be [out, in] with ints in [1, {MAX_DIM}], got {shape!r}")
    out_f, in_f = shape
    if out_f * in_f > max_elements:
        raise CodecError(f"{where}: merged {out_f}x{in_f} exceeds max_elements={max_elements}")
    if d["dtype"] not in DTYPES:
        raise CodecError(f"{where}: unknown dtype {d['dtype']!r}; expected one of {sorted(DTYPES)}")
    rank = _int(d, "rank", where=where, lo=1, hi=MAX_DIM)
    fs = d["factors"]
    if not isinstance(fs, list) or len(fs) != 2:
        raise CodecError(f"{where}: `factors` must be a list [A, B]")
    a, b = (
        _leaf(f, where=f"{where} factor {i}", base=base, body_size=body_size, max_elements=max_elements)
        for i, f in enumerate(fs)
    )
    if (a.name, b.name) != ("A", "B") or a.shape != (rank, in_f) or b.shape != (out_f, rank):
        raise CodecError(
            f"{where}: factors must be A {(rank, in_f)} and B {(out_f, rank)}, got {a.name} {a.shape}, {b.name} {b.shape}"
        )
    if a.dtype != d["dtype"] or b.dtype != d["dtype"]:
        raise CodecError(f"{where}: factor dtypes {a.dtype}/{b.dtype} differ from the entry's {d['dtype']}")
    offset = _int(d, "offset", where=where, lo=0, hi=body_size)
    nbytes = _int(d, "nbytes", where=where, lo=0, hi=body_size)
    lo, hi = min(a.offset, b.offset) - base, max(a.offset + a.nbytes, b.offset + b.nbytes) - base
    if (offset, nbytes) != (lo, hi - lo):
        raise CodecError(f"{where}: declared span [{offset}, {offset + nbytes}) differs from its factors' [{lo}, {hi})")
    return TensorEntry(name, (out_f, in_f), d["dtype"], "lora", None, base + offset, nbytes, rank, None, (a, b))


def parse_manifest(mv: memoryview, *, max_elements: int, max_total_elements: int | None = None) -> Manifest:
    """Read and validate the prefix and header; touches no body byte."""
    if type(max_elements) is not int or max_elements < 1:
        raise CodecError(f"`max_elements` must be a positive int, got {max_elements!r}")
    n = len(mv)
    if n < _PREFIX.size:
        raise CodecError(f"payload of {n} bytes is shorter than the {_PREFIX.size}-byte prefix: truncated")
    magic, version, flags, hlen, crc = _PREFIX.unpack_from(mv, 0)
    if magic != MAGIC:
        raise CodecError(f"payload does not start with the magic {MAGIC!r}: not a zoo-gym delta")
    if version != FORMAT_VERSION:
        raise CodecError(f"payload format version {version} is not supported; this reader knows {FORMAT_VERSION}")
    if flags != 0:
        raise CodecError(f"payload flags {flags:#x} are unknown (must be 0)")
    if hlen > MAX_HEADER_BYTES:
        raise CodecError(f"header length {hlen} exceeds the limit {MAX_HEADER_BYTES}")
    head_end = _PREFIX.size + hlen
    body_start = align(head_end, to=BODY_ALIGN)
    if body_start > n:
        raise CodecError(f"payload of {n} bytes ends inside its {hlen}-byte header: truncated")
    hb = bytes(mv[_PREFIX.size : head_end])
    if zlib.crc32(hb) != crc:
        raise CodecError("header checksum mismatch: the header is corrupt")
    if any(mv[head_end:body_start]):
        raise CodecError("padding after the header is not zero: corrupt payload")
    try:
        header = json.loads(hb.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_reject_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CodecError(f"header is not valid UTF-8 JSON: {e}") from None
    if not isinstance(header, dict) or set(header) != {"body_size", "metadata", "entries"}:
        raise CodecError("header must be a JSON object with keys body_size, metadata, entries")
    body_size = _int(header, "body_size", where="header", lo=0, hi=max(0, n - body_start))
    if body_start + body_size != n:
        raise CodecError(
            f"payload is {n} bytes but the header declares {body_start + body_size}: truncated or has trailing bytes"
        )
    metadata = header["metadata"]
    if not isinstance(metadata, dict):
        raise CodecError("header `metadata` must be a JSON object")
    raw = header["entries"]
    if not isinstance(raw, list) or len(raw) > MAX_ENTRIES:
        raise CodecError(f"header `entries` must be a list of at most {MAX_ENTRIES} tensors")
    entries: list[TensorEntry] = []
    names: set[str] = set()
    total = 0
    for i, d in enumerate(raw):
        where = f"entry {i}"
        kw = dict(where=where, base=body_start, body_size=body_size, max_elements=max_elements)
        e = _lora(d, **kw) if isinstance(d, dict) and d.get("codec") == "lora" else _leaf(d, **kw)
        if e.name in names:
            raise CodecError(f"{where}: tensor name {e.name!r} appears twice")
        names.add(e.name)
        total += e.numel
        if total > (max_total_elements or max_elements):
            cap = max_total_elements or max_elements
            raise CodecError(f"payload declares more than {cap} elements in total (max_total_elements)"
                             if max_total_elements else
                             f"payload declares more than max_elements={max_elements} elements in total")
        entries.append(e)
    regions = sorted((leaf.offset, leaf.nbytes, leaf.name) for e in entries for leaf in (e.factors or (e,)))
    for (o1, n1, a), (o2, _, b) in zip(regions, regions[1:]):
        if o1 + n1 > o2:
            raise CodecError(f"byte ranges of {a!r} and {b!r} overlap: corrupt header")
    return Manifest(entries, metadata, n, version, body_start)
