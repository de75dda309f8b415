"""Geometry shared by encoder and decoder: the 2-D view, scale groups and the byte size of each part.

Both sides compute sizes from the same pure functions, so the decoder can check every size the
header declares against what the shape, codec and group size imply, before it reads or allocates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from zoo_gym.codec.errors import CodecError

__all__ = [
    "DTYPES",
    "DENSE_CODECS",
    "QUANT_CODECS",
    "PASSTHROUGH_CODECS",
    "SCALE_DTYPES",
    "CODECS",
    "Groups",
    "view_2d",
    "groups_for",
    "leaf_nbytes",
    "leaf_parts",
    "align",
    "scale_nbytes",
    "resolve_scale_dtype",
]

# dtype name -> bytes per element (the dtypes a delta may have)
DTYPES: dict[str, int] = {"float32": 4, "bfloat16": 2, "float16": 2}
PASSTHROUGH_CODECS: dict[str, str] = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
QUANT_CODECS: tuple[str, ...] = ("bitdelta", "int8", "int4")
DENSE_CODECS: tuple[str, ...] = QUANT_CODECS + tuple(PASSTHROUGH_CODECS)
CODECS: tuple[str, ...] = ("bitdelta", "int8", "int4", "fp16", "bf16", "fp32", "lora", "auto")
# scale storage name -> bytes per stored scale; "log8" adds one float32 reference per tensor (see logscale)
SCALE_DTYPES: dict[str, int] = {"float32": 4, "bfloat16": 2, "log8": 1}
LOG8_REF_BYTES = 4

PART_ALIGN = 8  # bytes; scales start on this boundary inside a leaf


def align(n: int, *, to: int = PART_ALIGN) -> int:
    """Round ``n`` up to a multiple of ``to``."""
    return -(-n // to) * to


def view_2d(shape: tuple[int, ...]) -> tuple[int, int]:
    """The (rows, cols) view a codec works on: 0-D/1-D -> (1, n); rank > 2 -> (shape[0], prod(rest))."""
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], math.prod(shape[1:])


@dataclass(frozen=True)
class Groups:
    """Scale groups of a (rows, cols) view."""

    size: int  # effective group length along a row (== cols for per-row / per-tensor)
    n_groups: int  # groups per row
    scale_rows: int  # rows of the stored scale array: rows, or 1 for one scale per tensor

    @property
    def n_scales(self) -> int:
        return self.scale_rows * self.n_groups


def groups_for(*, rows: int, cols: int, group_size: int | None, codec: str) -> Groups:
    """Resolve the requested ``group_size`` (>0: groups of G, None: per row, -1: per tensor)."""
    if group_size is None:
        return Groups(size=cols, n_groups=1, scale_rows=rows)
    if group_size == -1:
        return Groups(size=cols, n_groups=1, scale_rows=1)
    if type(group_size) is not int or group_size <= 0:
        raise CodecError(f"`group_size` must be a positive int, None (per row) or -1 (per tensor), got {group_size!r}")
    if group_size >= cols:
        return Groups(size=cols, n_groups=1, scale_rows=rows)
    if codec == "bitdelta" and group_size % 8:
        raise CodecError(
            f"`group_size` must be a multiple of 8 for bitdelta so groups start on a byte, got {group_size}"
        )
    return Groups(size=group_size, n_groups=-(-cols // group_size), scale_rows=rows)


def leaf_parts(
    *, codec: str, shape: tuple[int, ...], group_size: int | None, scale_dtype: str | None
) -> tuple[int, int, int]:
    """(data bytes, scale offset inside the leaf, scale bytes) of one encoded tensor."""
    numel = math.prod(shape)
    if codec in PASSTHROUGH_CODECS:
        return numel * DTYPES[PASSTHROUGH_CODECS[codec]], 0, 0
    rows, cols = view_2d(shape)
    g = groups_for(rows=rows, cols=cols, group_size=group_size, codec=codec)
    if codec == "bitdelta":
        data = rows * -(-cols // 8)  # (rows, ceil(cols/8)) sign bytes
    elif codec == "int8":
        data = rows * cols
    elif codec == "int4":
        data = -(-(rows * cols) // 2)  # two codes per byte over the flattened view
    else:
        raise CodecError(f"unknown codec {codec!r}; expected one of {DENSE_CODECS}")
    return data, align(data), scale_nbytes(n_scales=g.n_scales, scale_dtype=scale_dtype)


def scale_nbytes(*, n_scales: int, scale_dtype: str) -> int:
    """Bytes of the scale part of a leaf holding ``n_scales`` scales."""
    if scale_dtype not in SCALE_DTYPES:
        raise CodecError(f"`scale_dtype` must be one of {sorted(SCALE_DTYPES)}, got {scale_dtype!r}")
    return n_scales * SCALE_DTYPES[scale_dtype] + (LOG8_REF_BYTES if scale_dtype == "log8" else 0)


def resolve_scale_dtype(scale_dtype: str | None, *, codec: str, group_size: int | None) -> str:
    """The scale storage a leaf uses: ``scale_dtype`` when given, else the default for its codec.

    Default: ``log8`` for bitdelta with groups (``group_size > 0``; 1 byte per group, see logscale),
    ``float32`` for per-row / per-tensor bitdelta and for int8/int4.
    """
    if scale_dtype is not None:
        return scale_dtype
    if codec == "bitdelta" and type(group_size) is int and group_size > 0:
        return DEFAULT_GROUP_SCALE_DTYPE
    return "float32"


DEFAULT_GROUP_SCALE_DTYPE = "log8"  # bitdelta groups: 1 byte per group, >= 30x at G=128 (benchmarks/codec.py)


def leaf_nbytes(*, codec: str, shape: tuple[int, ...], group_size: int | None, scale_dtype: str | None) -> int:
    """Total bytes of one encoded tensor (data, padding to the scales, scales)."""
    data, scale_off, scale_bytes = leaf_parts(codec=codec, shape=shape, group_size=group_size, scale_dtype=scale_dtype)
    return data if scale_bytes == 0 else scale_off + scale_bytes
