"""The public codec API: encode a delta to bytes, read its manifest, decode it whole or tensor by tensor.

``codec="auto"`` (the client's default) takes per tensor the SMALLEST candidate encoding (bitdelta with
the given group size, int4, int8, fp16, and for LoRA factors the factors under ``lora_codec``) whose
relative L2 error against the input is ``<= max_rel_error``, else the exact passthrough of the tensor's
own dtype, so a choice always exists. The default 0.7 admits a 1-bit sign code on dense deltas
(``sqrt(1 - 2/pi) = 0.603`` on Gaussian data); it bounds the error, it does not guarantee quality.
Lower bounds trade bytes for fidelity (0.3 picks int4, 0.05 int8 on Gaussian data; 0.5 keeps exact
LoRA factors on narrow matrices). Why these numbers: docs/design/codec.md.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
from torch import Tensor

from zoo_gym.codec.bitdelta import BitDeltaPacked
from zoo_gym.codec.container import (
    BODY_ALIGN,
    MAX_METADATA_BYTES,
    MAX_NAME_CHARS,
    Manifest,
    TensorEntry,
    as_buffer,
    build_payload,
    parse_manifest,
)
from zoo_gym.codec.errors import CodecError
from zoo_gym.codec.layout import CODECS, DENSE_CODECS, SCALE_DTYPES, align, leaf_parts, resolve_scale_dtype
from zoo_gym.codec.leaf import TORCH_DTYPES, Leaf, decode_leaf, decode_leaf_rows, dtype_name, encode_leaf, packed_leaf
from zoo_gym.codec.lora import LoraFactors

__all__ = ["encode", "decode", "decode_tensor", "decode_factors", "read_manifest", "read_bitdelta", "sent_sq_norm",
           "sha256_hex",
           "relative_error", "DEFAULT_MAX_ELEMENTS"]

DEFAULT_MAX_ELEMENTS = 2**31  # one tensor (and a whole `decode()`, which allocates every tensor)
# all of a payload's tensors when they are read one at a time (`read_manifest`, `decode_tensor`): a 72B model's
# full delta fits; the server checks every entry against its base's shapes
DEFAULT_MAX_TOTAL_ELEMENTS = 2**38
_PASSTHROUGH_FOR = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def sha256_hex(payload: Any) -> str:
    """Hex sha256 of a payload buffer (bytes, bytearray, memoryview or mmap), without copying it."""
    return hashlib.sha256(as_buffer(payload)).hexdigest()


def relative_error(approx: Tensor, exact: Tensor) -> float:
    """||approx - exact||_2 / ||exact||_2 in float64 (0 when both are zero, inf when only exact is)."""
    num = float(torch.linalg.vector_norm((approx.double() - exact.double()).reshape(-1)))
    den = float(torch.linalg.vector_norm(exact.double().reshape(-1)))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


# ---------------------------------------------------------------- encoding

def _check_args(*, codec: str, group_size: Any, vector_codec: str, lora_codec: str, max_rel_error: float,
                scale_dtype: str | None) -> None:
    if codec not in CODECS:
        raise CodecError(f"`codec` must be one of {CODECS}, got {codec!r}")
    if vector_codec not in DENSE_CODECS:
        raise CodecError(f"`vector_codec` must be one of {DENSE_CODECS} (default fp16), got {vector_codec!r}")
    if lora_codec not in DENSE_CODECS:
        raise CodecError(f"`lora_codec` must be one of {DENSE_CODECS}, got {lora_codec!r}")
    if not (group_size is None or group_size == -1 or (type(group_size) is int and group_size > 0)):
        raise CodecError(f"`group_size` must be a positive int, None (per row) or -1 (per tensor), got {group_size!r}")
    uses_bitdelta = "bitdelta" in (codec, vector_codec, lora_codec) or codec == "auto"
    if uses_bitdelta and type(group_size) is int and group_size > 0 and group_size % 8:
        raise CodecError(f"`group_size` must be a multiple of 8 when bitdelta is used, got {group_size}")
    if not (isinstance(max_rel_error, (int, float)) and math.isfinite(max_rel_error) and max_rel_error >= 0):
        raise CodecError(f"`max_rel_error` must be a finite number >= 0, got {max_rel_error!r}")
    if scale_dtype is not None and scale_dtype not in SCALE_DTYPES:
        raise CodecError(f"`scale_dtype` must be None (the codec's default) or one of {sorted(SCALE_DTYPES)}, "
                         f"got {scale_dtype!r}")


def _candidates(x: Tensor, *, group_size: int | None, scale_dtype: str | None, what: str) -> list[Leaf | tuple]:
    """Dense candidates for auto in ascending size (encoded lazily by the caller)."""
    native = _PASSTHROUGH_FOR[dtype_name(x.dtype, what=what)]
    names = ["bitdelta", "int4", "int8", "fp16", native]
    return [(c, group_size if c in ("bitdelta", "int4", "int8") else None) for c in dict.fromkeys(names)]


def _encode_value(value: Tensor | LoraFactors, *, name: str, codec: str, group_size: int | None, vector_codec: str,
                  lora_codec: str, max_rel_error: float, scale_dtype: str | None) -> Leaf | tuple[LoraFactors, Leaf, Leaf]:
    what = f"tensor {name!r}"

    def leaf(x: Tensor, c: str, *, w: str = what) -> Leaf:
        return encode_leaf(x, codec=c, group_size=group_size, scale_dtype=scale_dtype, what=w)

    def factors(f: LoraFactors) -> tuple[LoraFactors, Leaf, Leaf]:
        if lora_codec != "fp32":
            f = balanced(f)
        return f, leaf(f.A, lora_codec, w=f"{what} factor A"), leaf(f.B, lora_codec, w=f"{what} factor B")

    if isinstance(value, LoraFactors):
        if codec == "lora":
            return factors(value)
        dense = value.merged().to(value.dtype)  # (out, in)
    elif isinstance(value, Tensor):
        dense = value
    else:
        raise CodecError(f"{what}: values must be Tensors or LoraFactors, got {type(value).__name__}")
    if codec in ("fp16", "bf16", "fp32"):
        return leaf(dense, codec)
    if dense.dim() <= 1:
        return leaf(dense, vector_codec)
    if codec == "lora":
        return leaf(dense, "fp16")
    if codec != "auto":
        return leaf(dense, codec)
    # auto: smallest candidate within max_rel_error; sizes follow from the shape alone
    exact = value.merged() if isinstance(value, LoraFactors) else dense.detach().cpu().float()
    options: list[tuple[int, Any]] = []
    for c, g in _candidates(dense, group_size=group_size, scale_dtype=scale_dtype, what=what):
        options.append((_leaf_size(c, tuple(dense.shape), g, scale_dtype), (c, g)))
    if isinstance(value, LoraFactors):
        size = sum(_leaf_size(lora_codec, tuple(t.shape), group_size, scale_dtype) for t in (value.A, value.B))
        options.append((size, ("lora", None)))
    options.sort(key=lambda o: o[0])  # stable: ties keep the order above
    for _, (c, g) in options:
        if c == "lora":
            enc = factors(value)
            approx = LoraFactors(enc[1].decode(), enc[2].decode()).merged()
        else:
            try:
                enc = encode_leaf(dense, codec=c, group_size=g, scale_dtype=scale_dtype, what=what)
            except CodecError:
                if c == _PASSTHROUGH_FOR[dtype_name(dense.dtype, what=what)]:
                    raise
                continue  # e.g. values beyond fp16 range: not a candidate
            approx = enc.decode().float()
        if relative_error(approx, exact) <= max_rel_error:
            return enc
    raise CodecError(f"{what}: no candidate met max_rel_error={max_rel_error}")  # unreachable: passthrough is exact


def balanced(f: LoraFactors) -> LoraFactors:
    """The same product B @ A with each rank component's A row and B column at equal RMS.

    LoRA leaves B tiny (it starts at zero: a few steps in, its entries are ~1e-5) and A at ~1e-2. In
    float16 everything below 6.1e-5 is subnormal, with fewer mantissa bits the smaller it is: B
    entries of 2e-5 kept about 4% relative precision, and the merged delta of a 0.6B-sized LoRA lost
    0.1% of its norm in transit. Scaling A's row k by s_k and B's column k by 1/s_k changes the product
    by float32 rounding only, and puts both factors in float16's normal range."""
    a, b = f.A.detach().float(), f.B.detach().float()  # (r, in), (out, r)
    rms_a = a.pow(2).mean(dim=1).sqrt()  # (r,)
    rms_b = b.pow(2).mean(dim=0).sqrt()  # (r,)
    ok = (rms_a > 0) & (rms_b > 0) & torch.isfinite(rms_a) & torch.isfinite(rms_b)
    if not bool(ok.any()):
        return f
    s = torch.where(ok, (rms_b / torch.where(ok, rms_a, 1.0)).sqrt(), torch.ones_like(rms_a))  # (r,)
    return LoraFactors(A=(a * s[:, None]).to(f.dtype), B=(b / s[None, :]).to(f.dtype))


def _leaf_size(codec: str, shape: tuple[int, ...], group_size: int | None, scale_dtype: str | None) -> int:
    quant = codec in ("bitdelta", "int4", "int8")
    sd = resolve_scale_dtype(scale_dtype, codec=codec, group_size=group_size) if quant else None
    data, off, sb = leaf_parts(codec=codec, shape=shape, group_size=group_size if quant else None, scale_dtype=sd)
    return data if not sb else off + sb


def _place(leaf: Leaf, *, name: str, offset: int, body: list[Any]) -> tuple[dict[str, Any], int]:
    """Append a leaf's bytes at ``offset`` (64-aligned) to ``body``; returns its header entry and the new end."""
    data_bytes, scale_off, scale_bytes = leaf_parts(codec=leaf.codec, shape=leaf.shape, group_size=leaf.group_size,
                                                    scale_dtype=leaf.scale_dtype)
    body.append(leaf.data)
    if scale_bytes:
        body.append(bytes(scale_off - data_bytes))
        body.append(leaf.scales)
    nbytes = leaf.nbytes
    end = align(offset + nbytes, to=BODY_ALIGN)
    body.append(bytes(end - offset - nbytes))
    entry = {"name": name, "shape": list(leaf.shape), "dtype": leaf.dtype, "codec": leaf.codec,
             "group_size": leaf.group_size, "scale_dtype": leaf.scale_dtype, "offset": offset, "nbytes": nbytes}
    return entry, end


def encode(
    delta: Mapping[str, Tensor | LoraFactors],
    *,
    codec: str = "bitdelta",
    group_size: int | None = 128,
    vector_codec: str = "fp16",
    lora_codec: str = "fp16",
    max_rel_error: float = 0.7,
    metadata: Mapping[str, Any] | None = None,
    scale_dtype: str | None = None,
) -> bytes:
    """Encode a delta (name -> Tensor or LoraFactors) into one payload.

    ``group_size``: >0 groups of G along each row (a multiple of 8 for bitdelta), None one scale per
    row, -1 one scale per tensor. 0-D/1-D tensors use ``vector_codec`` under bitdelta/int8/int4/lora/auto.
    ``scale_dtype``: how bitdelta/int8/int4 store their scales: "float32", "bfloat16" or "log8" (one
    float32 reference per tensor and one byte per group on a 1/16-octave log grid; see ``logscale``).
    None (default) means float32, except bitdelta with groups (``group_size > 0``), which uses
    ``layout.DEFAULT_GROUP_SCALE_DTYPE``.
    """
    _check_args(codec=codec, group_size=group_size, vector_codec=vector_codec, lora_codec=lora_codec,
                max_rel_error=max_rel_error, scale_dtype=scale_dtype)
    if not isinstance(delta, Mapping):
        raise CodecError(f"`delta` must be a mapping of name -> tensor, got {type(delta).__name__}")
    meta = dict(metadata or {})
    try:
        meta_bytes = len(json.dumps(meta, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise CodecError(f"`metadata` must be a JSON-able dict of finite numbers, strings, lists and dicts: {e}") from e
    if meta_bytes > MAX_METADATA_BYTES:
        raise CodecError(f"`metadata` is {meta_bytes} bytes of JSON; keep it under {MAX_METADATA_BYTES}")
    entries: list[dict[str, Any]] = []
    body: list[Any] = []
    offset = 0
    for name, value in delta.items():
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_CHARS:
            raise CodecError(f"tensor names must be non-empty strings of at most {MAX_NAME_CHARS} chars, got {name!r}")
        enc = _encode_value(value, name=name, codec=codec, group_size=group_size, vector_codec=vector_codec,
                            lora_codec=lora_codec, max_rel_error=max_rel_error, scale_dtype=scale_dtype)
        if isinstance(enc, Leaf):
            entry, offset = _place(enc, name=name, offset=offset, body=body)
        else:
            f, a, b = enc
            start = offset
            ea, offset = _place(a, name="A", offset=offset, body=body)
            eb, end_b = _place(b, name="B", offset=offset, body=body)
            offset = end_b
            entry = {"name": name, "shape": list(f.shape), "dtype": dtype_name(f.dtype, what=f"tensor {name!r}"),
                     "codec": "lora", "rank": f.rank, "offset": start, "nbytes": eb["offset"] + eb["nbytes"] - start,
                     "factors": [ea, eb]}
        entries.append(entry)
    return build_payload(entries=entries, metadata=meta, body=body, body_size=offset)


# ---------------------------------------------------------------- decoding

def _leaf_bytes(mv: memoryview, e: TensorEntry) -> tuple[np.ndarray, np.ndarray | None]:
    data_bytes, scale_off, scale_bytes = leaf_parts(codec=e.codec, shape=e.shape, group_size=e.group_size,
                                                    scale_dtype=e.scale_dtype)
    data = np.frombuffer(mv, dtype=np.uint8, count=data_bytes, offset=e.offset)
    scales = np.frombuffer(mv, dtype=np.uint8, count=scale_bytes, offset=e.offset + scale_off) if scale_bytes else None
    return data, scales


def _decode_leaf_entry(mv: memoryview, e: TensorEntry, *, what: str) -> Tensor:
    data, scales = _leaf_bytes(mv, e)
    return decode_leaf(data, scales, codec=e.codec, shape=e.shape, dtype=e.dtype, group_size=e.group_size,
                       scale_dtype=e.scale_dtype, what=what)


def _factors(mv: memoryview, e: TensorEntry) -> LoraFactors:
    a, b = (_decode_leaf_entry(mv, f, what=f"tensor {e.name!r} factor {f.name}") for f in e.factors)
    return LoraFactors(a, b)


def _decode_entry(mv: memoryview, e: TensorEntry) -> Tensor:
    if e.codec == "lora":
        return _factors(mv, e).merged().to(TORCH_DTYPES[e.dtype])
    return _decode_leaf_entry(mv, e, what=f"tensor {e.name!r}")


def _guard(fn):
    """Public decoders raise CodecError only: a slip past validation must not surface as IndexError."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except CodecError:
            raise
        except (IndexError, KeyError, ValueError, TypeError, RuntimeError, OverflowError) as e:
            raise CodecError(f"malformed payload: {type(e).__name__}: {e}") from e

    return wrapper


def _manifest_for(mv: memoryview, manifest: Manifest | None, max_elements: int) -> Manifest:
    if manifest is None:
        return parse_manifest(mv, max_elements=max_elements, max_total_elements=DEFAULT_MAX_TOTAL_ELEMENTS)
    if manifest.payload_size != len(mv):
        raise CodecError(f"manifest is for a payload of {manifest.payload_size} bytes, this one has {len(mv)}")
    return manifest


@_guard
def read_manifest(payload: Any, *, max_elements: int = DEFAULT_MAX_ELEMENTS,
                  max_total_elements: int = DEFAULT_MAX_TOTAL_ELEMENTS) -> Manifest:
    """The validated header (names, shapes, dtypes, codecs, sizes) without decoding the body: each tensor
    within `max_elements`, all of them within `max_total_elements`."""
    return parse_manifest(as_buffer(payload), max_elements=max_elements, max_total_elements=max_total_elements)


@_guard
def decode(payload: Any, *, max_elements: int = DEFAULT_MAX_ELEMENTS) -> dict[str, Tensor]:
    """Every tensor with its original shape and dtype; LoRA entries come back merged (B @ A)."""
    mv = as_buffer(payload)
    m = parse_manifest(mv, max_elements=max_elements)
    return {e.name: _decode_entry(mv, e) for e in m.entries}


@_guard
def decode_tensor(payload: Any, name: str, *, max_elements: int = DEFAULT_MAX_ELEMENTS,
                  manifest: Manifest | None = None) -> Tensor:
    """One tensor by name (random access); pass ``manifest`` from read_manifest to skip re-parsing."""
    mv = as_buffer(payload)
    return _decode_entry(mv, _manifest_for(mv, manifest, max_elements).entry(name))


@_guard
def decode_rows(payload: Any, name: str, r0: int, r1: int, *, manifest: Manifest | None = None) -> Tensor | None:
    """Rows [r0, r1) of tensor `name`'s 2-D view, (r1 - r0, cols) in its dtype, decoded from those rows' bytes
    alone: the numbers of `decode_tensor(...)`'s rows. None for the codecs whose rows another path reads
    (bitdelta: `read_bitdelta(...).rows_dense`; lora: B's rows times A) and int4 rows not starting on a byte."""
    mv = as_buffer(payload)
    e = _manifest_for(mv, manifest, DEFAULT_MAX_ELEMENTS).entry(name)
    if e.codec not in DENSE_CODECS or e.codec == "bitdelta":
        return None
    data, scales = _leaf_bytes(mv, e)
    return decode_leaf_rows(data, scales, codec=e.codec, shape=e.shape, dtype=e.dtype, group_size=e.group_size,
                            scale_dtype=e.scale_dtype, r0=r0, r1=r1, what=f"tensor {name!r}")


@_guard
def decode_factors(payload: Any, name: str, *, manifest: Manifest | None = None) -> LoraFactors:
    """The LoRA factors of a ``lora`` entry, without merging."""
    mv = as_buffer(payload)
    e = _manifest_for(mv, manifest, DEFAULT_MAX_ELEMENTS).entry(name)
    if e.codec != "lora":
        raise CodecError(f"tensor {name!r} is encoded with {e.codec}, not lora")
    return _factors(mv, e)


@_guard
def read_bitdelta(payload: Any, name: str, *, manifest: Manifest | None = None) -> BitDeltaPacked:
    """The packed sign bits and float32 scales of a ``bitdelta`` entry, without decoding to floats."""
    mv = as_buffer(payload)
    e = _manifest_for(mv, manifest, DEFAULT_MAX_ELEMENTS).entry(name)
    if e.codec != "bitdelta":
        raise CodecError(f"tensor {name!r} is encoded with {e.codec}, not bitdelta")
    data, scales = _leaf_bytes(mv, e)
    return packed_leaf(data, scales, shape=e.shape, group_size=e.group_size, scale_dtype=e.scale_dtype,
                       what=f"tensor {name!r}")


@_guard
def sent_sq_norm(payload: Any, name: str, *, manifest: Manifest | None = None) -> float | None:
    """The squared L2 norm of tensor `name` as decoded, from what was sent and nothing decoded: float32 LoRA
    factors by their r x r Gram matrices (`LoraFactors.merged_sq_norm`), float32 BitDelta by its scales
    (`BitDeltaPacked.sq_norm`). None for any other entry, or when those are not safe (non-finite, a product
    that could overflow): the caller decodes."""
    mv = as_buffer(payload)
    e = _manifest_for(mv, manifest, DEFAULT_MAX_ELEMENTS).entry(name)
    if e.dtype != "float32":
        return None
    if e.codec == "lora":
        return _factors(mv, e).merged_sq_norm()
    if e.codec == "bitdelta":
        return read_bitdelta(mv, name, manifest=manifest).sq_norm()
    return None
