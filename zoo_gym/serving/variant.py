"""A personal variant on disk (``NAME.zgd``) and in memory.

File: one ``zoo_gym.codec`` payload (2-D weights bitdelta, groups of 128 along each row, log8 scales;
1-D tensors fp16) whose metadata is the manifest ``{"zoo_gym_variant": 1, "base_sha256": ..., ...}``.
``base_sha256`` is the sha256 of the base's ``*.safetensors`` files concatenated in sorted name order; a
variant is served only over a base with that sha256 (:class:`VariantMismatch` otherwise). In memory
(:class:`Variant`) signs stay packed and scales stay as coded (log8 codes plus one float32 reference per
tensor, or float32); codes become float32 only inside the kernels, a tile at a time. 1-D deltas are
dense. :attr:`Variant.nbytes` counts these tensors. Details: docs/design/serving.md.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import re
from dataclasses import dataclass, field

import torch

from zoo_gym import codec
from zoo_gym.codec.logscale import LOG8_MULT

FORMAT = 1
SUFFIX = ".zgd"
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")
_READ_CHUNK = 8 << 20
_LOG8_MULT = torch.from_numpy(LOG8_MULT)  # float32 (256,): the log8 grid multiplier of each code


class VariantError(ValueError):
    """A variant file is unreadable or not a variant; the message says which and why."""


class VariantMismatch(VariantError):
    """A variant was built for another base."""


def weights_sha256(base_dir: str | pathlib.Path) -> str:
    """sha256 of the base's ``*.safetensors`` bytes in sorted file-name order (see module docstring)."""
    files = sorted(pathlib.Path(base_dir).glob("*.safetensors"))
    if not files:
        raise VariantError(f"{base_dir}: no *.safetensors weights (is it a Hugging Face model directory?)")
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            while chunk := fh.read(_READ_CHUNK):
                h.update(chunk)
    return h.hexdigest()


def resolve_base_dir(base: str) -> pathlib.Path:
    """A built-in base, a local Hugging Face directory, a GGUF file or a hub id in the local cache
    (zoo_gym/gym_train/bases.py; nothing is downloaded from a hub)."""
    from zoo_gym.gym_train.bases import BaseModelError, resolve_base

    try:
        return resolve_base(base)
    except BaseModelError as exc:
        raise VariantError(str(exc)) from None


def check_name(name: str) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise VariantError(f"variant name {name!r} must be 1-64 letters, digits, '.', '_' or '-' "
                           "(starting with a letter or digit)")
    return name


def encode_variant(delta: dict, *, base_sha256: str, info: dict | None = None, group_size: int = 128) -> bytes:
    """The payload of a variant: bitdelta 2-D tensors (log8 group scales), fp16 1-D ones."""
    meta = {"zoo_gym_variant": FORMAT, "base_sha256": base_sha256, **(info or {})}
    return codec.encode(delta, codec="bitdelta", group_size=group_size, scale_dtype="log8", metadata=meta)


def write_variant(path: str | pathlib.Path, payload: bytes) -> pathlib.Path:
    """Write atomically (temporary file, fsync, rename)."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(payload)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def read_manifest(payload) -> dict:
    """The variant manifest (the payload's metadata); VariantError when it is not a variant."""
    try:
        meta = codec.read_manifest(payload).metadata
    except codec.CodecError as exc:
        raise VariantError(f"not a variant payload: {exc}") from None
    if meta.get("zoo_gym_variant") != FORMAT or not isinstance(meta.get("base_sha256"), str):
        raise VariantError("not a variant payload: its metadata has no zoo_gym_variant/base_sha256 manifest")
    return meta


@dataclass
class PackedWeight:
    """One 2-D bitdelta delta, packed: ``delta[r, c] = scale[r, c // group_size] * (+1 if bit else -1)``.

    ``scale`` is ``scales`` (float32) when ``scale_ref`` is None, else ``float32(scale_ref *
    LOG8_MULT[scales])`` with ``scales`` the uint8 log8 codes: bit for bit what the codec decodes.
    """

    shape: tuple[int, int]  # (rows, cols) as stored in the base (a Conv1D's is (in, out))
    signs: torch.Tensor  # uint8 (rows, ceil(cols/8)), little bit order
    scales: torch.Tensor  # uint8 log8 codes (scale_ref set) or float32, (rows, n_groups)
    group_size: int
    scale_ref: float | None = None  # the tensor's log8 reference (a float32 value), None for float32 scales

    def __post_init__(self) -> None:
        """ValueError unless signs and scales fit ``shape`` with one group layout: the kernels read them by
        address, so a layer checks each weight once here instead of at every call."""
        rows, cols = self.shape
        sc, n_groups = self.scales, self.scales.shape[-1] if self.scales.dim() == 2 else -1
        ok = (self.signs.dtype == torch.uint8 and tuple(self.signs.shape) == (rows, -(-cols // 8))
              and sc.dim() == 2 and sc.shape[0] in (1, rows) and n_groups >= 1 and sc.device == self.signs.device
              and (sc.dtype == torch.uint8 if self.scale_ref is not None else sc.is_floating_point()))
        if ok and n_groups > 1:
            ok = self.group_size > 0 and self.group_size % 8 == 0 and -(-cols // self.group_size) == n_groups
        if not ok:
            raise ValueError(f"packed signs {tuple(self.signs.shape)} {self.signs.dtype} / scales {tuple(sc.shape)} "
                             f"{sc.dtype} do not fit a {self.shape} weight with groups of {self.group_size}")

    @property
    def nbytes(self) -> int:
        """Bytes resident: the packed signs, the scales as held, and 4 for a float32 log8 reference."""
        return (self.signs.numel() * self.signs.element_size() + self.scales.numel() * self.scales.element_size()
                + (4 if self.scale_ref is not None else 0))

    def scales_f32(self, rows=slice(None)) -> torch.Tensor:
        """float32 scales of ``rows`` (a slice or an index tensor): decoded here for those rows only."""
        sc = self.scales[rows]
        if self.scale_ref is None:
            return sc
        mult = _LOG8_MULT.to(sc.device)[sc.long()]
        return torch.tensor(self.scale_ref, dtype=torch.float32, device=sc.device) * mult


@dataclass
class Variant:
    name: str
    base_sha256: str
    packed: dict[str, PackedWeight] = field(default_factory=dict)  # base parameter name -> packed delta
    dense: dict[str, torch.Tensor] = field(default_factory=dict)  # 1-D deltas (norms, biases), fp16 as coded
    manifest: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return (sum(p.nbytes for p in self.packed.values())
                + sum(t.numel() * t.element_size() for t in self.dense.values()))


def load_variant(path: str | pathlib.Path, *, base_sha256: str, name: str | None = None) -> Variant:
    """Read ``path`` into a packed :class:`Variant`; VariantMismatch (one line) when built for another base."""
    path = pathlib.Path(path)
    name = check_name(name or path.name.removesuffix(SUFFIX))
    try:
        payload = path.read_bytes()
    except OSError as exc:
        raise VariantError(f"variant {name!r}: cannot read {path}: {exc.strerror}") from None
    return variant_from_payload(payload, name=name, base_sha256=base_sha256)


def _held_scales(scales: torch.Tensor, scale_dtype: str) -> tuple[torch.Tensor, float | None]:
    """(what a PackedWeight keeps, its log8 reference): the uint8 codes of log8-coded scales, else float32."""
    if scale_dtype == "log8":
        from zoo_gym.serving.kernels import log8_scale_codes  # numba: imported when serving only

        try:
            return log8_scale_codes(scales)  # exact: float32(ref * LOG8_MULT[codes]) == scales
        except ValueError:  # not on one grid (cannot happen for a payload the codec checked): stay float32
            pass
    return scales.clone(), None


def variant_from_payload(payload, *, name: str, base_sha256: str) -> Variant:
    meta = read_manifest(payload)
    if meta["base_sha256"] != base_sha256:
        raise VariantMismatch(f"variant {name!r} was built for base {meta['base_sha256'][:12]}, "
                              f"this server's base is {base_sha256[:12]}; refusing it")
    v = Variant(name=name, base_sha256=base_sha256, manifest=meta)
    try:
        manifest = codec.read_manifest(payload)
        for e in manifest.entries:
            if e.codec == "bitdelta" and len(e.shape) == 2:
                p = codec.read_bitdelta(payload, e.name, manifest=manifest)
                scales, ref = _held_scales(p.scales, e.scale_dtype)
                v.packed[e.name] = PackedWeight(shape=(p.rows, p.cols), signs=p.signs.clone(), scales=scales,
                                                group_size=p.group_size, scale_ref=ref)
            elif len(e.shape) == 1:
                t = codec.decode_tensor(payload, e.name, manifest=manifest)
                # held as coded: fp16 values are exactly fp16 (half the bytes); anything else as float32
                v.dense[e.name] = t.to(torch.float16 if e.codec == "fp16" else torch.float32).clone()
            else:
                raise VariantError(f"variant {name!r}: tensor {e.name!r} {tuple(e.shape)} is coded {e.codec}; "
                                   "gym-serve serves 2-D weights coded bitdelta and 1-D tensors only")
    except (codec.CodecError, ValueError) as exc:  # ValueError: signs/scales that do not fit (PackedWeight)
        raise VariantError(f"variant {name!r}: malformed payload: {exc}") from None
    return v
