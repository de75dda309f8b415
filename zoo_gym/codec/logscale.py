"""``log8`` scale storage: one float32 reference per tensor and one uint8 log-grid code per group.

Grid (log-domain, as the shared-exponent formats of Rouhani et al., "Microscaling Data Formats for Deep
Learning", 2023, arXiv:2310.10537): code 0 -> scale 0; code c in 1..255 -> ``r * 2 ** (-(255 - c) / 16)``,
``r`` the tensor's largest group scale (its group gets code 255). ``mode="nearest"`` (BitDelta) picks the
grid point nearest each scale in linear distance, ``mode="ceil"`` (integer codes) the smallest one
``>=`` it, so nothing is clipped. Decoding is ``float32(r * MULT[c])``: one IEEE multiply by an exact
constant. Bytes: ``r`` as little-endian float32, then the codes, uint8 (scale_rows, n_groups) row-major;
the decoder checks ``r`` finite and >= 0, ``r == 0`` iff every code is 0, else a largest code of 255.
Design: docs/design/codec.md.
"""

from __future__ import annotations

import numpy as np

from zoo_gym.codec.errors import CodecError

__all__ = ["STEPS_PER_OCTAVE", "LOG8_HEADER_BYTES", "LOG8_MULT", "log8_nbytes", "log8_codes", "log8_scales",
           "log8_to_bytes", "log8_from_bytes"]

STEPS_PER_OCTAVE = 16
LOG8_HEADER_BYTES = 4  # the float32 reference scale
_CHUNK = 8192  # scales per chunk when choosing codes: 64 KiB float64 temporaries

# float32 nearest to 2 ** (-j / 16), j = 0..15 (written out so decoding never depends on a libm pow)
_FRAC = np.array([float.fromhex(h) for h in (
    "0x1.000000p+0", "0x1.ea4afap-1", "0x1.d5818ep-1", "0x1.c199bep-1",
    "0x1.ae89fap-1", "0x1.9c4918p-1", "0x1.8ace54p-1", "0x1.7a1148p-1",
    "0x1.6a09e6p-1", "0x1.5ab07ep-1", "0x1.4bfdaep-1", "0x1.3dea64p-1",
    "0x1.306fe0p-1", "0x1.2387a6p-1", "0x1.172b84p-1", "0x1.0b5586p-1",
)], dtype=np.float32)  # (16,)

_STEPS_DOWN = 255 - np.arange(256)  # (256,) steps below the reference for code c
# float32 (256,): the grid multiplier of each code; exact products (a power of two times FRAC[j])
LOG8_MULT = np.ldexp(_FRAC[_STEPS_DOWN % 16], -(_STEPS_DOWN // 16)).astype(np.float32)
LOG8_MULT[0] = 0.0


def log8_nbytes(n_scales: int) -> int:
    """Bytes of the log8 scale part: the float32 reference plus one code per scale."""
    return LOG8_HEADER_BYTES + n_scales


def log8_scales(ref: np.float32, codes: np.ndarray) -> np.ndarray:
    """float32 scales (codes.shape) = float32(ref * LOG8_MULT[code]) exactly as the decoder computes them."""
    return np.float32(ref) * LOG8_MULT[codes]


def log8_codes(scales: np.ndarray, *, mode: str) -> tuple[np.float32, np.ndarray]:
    """(reference, uint8 codes) for finite scales >= 0 of any shape (float32 or float64).

    ``mode="nearest"``: the grid point nearest each scale in linear distance (BitDelta's L2-optimal
    choice, see docs/design/codec.md). ``mode="ceil"``: the smallest grid point >= each scale (int codes
    must not clip). The reference is float32(max scale) (rounded up in ``ceil`` mode).
    """
    if mode not in ("nearest", "ceil"):
        raise ValueError(f"`mode` must be 'nearest' or 'ceil', got {mode!r}")
    m = np.asarray(scales, dtype=np.float64)
    if m.size and not (np.isfinite(m).all() and (m >= 0).all()):
        raise CodecError("log8 scales must be finite and >= 0")
    top = float(m.max()) if m.size else 0.0
    ref = np.float32(top)
    if mode == "ceil" and float(ref) < top:
        ref = np.nextafter(ref, np.float32(np.inf))
    if ref == 0 or not np.isfinite(ref):
        if not np.isfinite(ref):
            raise CodecError(f"largest scale {top!r} exceeds the float32 range of the log8 reference")
        return np.float32(0.0), np.zeros(m.shape, dtype=np.uint8)
    grid = log8_scales(ref, np.arange(256)).astype(np.float64)  # (256,) the stored values, ascending
    flat = m.reshape(-1)
    codes = np.empty(flat.shape, dtype=np.uint8)
    for i in range(0, flat.size, _CHUNK):  # chunks keep every temporary small and in cache
        codes[i : i + _CHUNK] = _codes_chunk(flat[i : i + _CHUNK], grid=grid, ref=float(ref), mode=mode)
    return ref, codes.reshape(m.shape)


def _codes_chunk(m: np.ndarray, *, grid: np.ndarray, ref: float, mode: str) -> np.ndarray:
    """int64 codes (n,) of float64 scales m (n,) against the stored grid (256,)."""
    with np.errstate(divide="ignore"):
        pos = np.log2(m / ref)  # -inf for m == 0
    pos *= STEPS_PER_OCTAVE
    pos += 255.0
    # log-neighbour below, kept in [1, 254] so lo and lo + 1 are both codes of the nonzero grid. Rounding
    # in log2 can move it by one only when m is within ~1e-13 of a grid point, which stays a candidate.
    lo = np.clip(pos, 1.0, 254.0, out=pos).astype(np.int64)  # floor: pos >= 1 after the clip
    g_lo, g_hi = grid[lo], grid[lo + 1]
    if mode == "nearest":
        codes = np.where(m - g_lo <= g_hi - m, lo, lo + 1)
        return np.where(m < 0.5 * grid[1], 0, codes)  # nearer to 0 than to the smallest nonzero point
    codes = np.where(g_lo >= m, lo, lo + 1)
    for _ in range(2):  # guard the off-by-one of the floor in both directions
        codes = np.where((codes < 255) & (grid[codes] < m), codes + 1, codes)
        codes = np.where((codes > 1) & (grid[codes - 1] >= m), codes - 1, codes)
    return np.where(m == 0, 0, codes)


def log8_to_bytes(ref: np.float32, codes: np.ndarray) -> np.ndarray:
    """uint8 (4 + n,): little-endian float32 reference, then the codes row-major."""
    head = np.array([ref], dtype="<f4").view(np.uint8)
    return np.concatenate([head, np.ascontiguousarray(codes, dtype=np.uint8).reshape(-1)])


def log8_from_bytes(raw: np.ndarray, *, shape: tuple[int, int], what: str) -> np.ndarray:
    """float32 scales ``shape`` from the log8 scale part, after checking reference and codes agree."""
    raw = np.asarray(raw, dtype=np.uint8)
    n = shape[0] * shape[1]
    if raw.size != log8_nbytes(n):
        raise CodecError(f"{what}: log8 scale part is {raw.size} bytes, expected {log8_nbytes(n)}")
    ref = np.frombuffer(raw[:LOG8_HEADER_BYTES].tobytes(), dtype="<f4")[0]
    codes = raw[LOG8_HEADER_BYTES:].reshape(shape)
    if not np.isfinite(ref) or ref < 0:
        raise CodecError(f"{what}: log8 reference scale is {float(ref)!r}; it must be finite and >= 0 (corrupt body)")
    top = int(codes.max()) if n else 0
    if ref == 0 and top != 0:
        raise CodecError(f"{what}: log8 reference scale is 0 but codes are non-zero (corrupt body)")
    if ref > 0 and top != 255:
        raise CodecError(
            f"{what}: log8 reference scale is {float(ref)!r} but no group has code 255 (largest {top}); "
            "the encoder always writes 255 for the largest group, so the body is corrupt"
        )
    return log8_scales(np.float32(ref), codes)
