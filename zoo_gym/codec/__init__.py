"""zoo_gym.codec: a delta (name -> tensor) to bytes and back.

Codecs: ``bitdelta`` (1-bit signs + mean-|x| scales per group; Liu et al. 2024, arXiv:2402.10193),
``int8``/``int4`` (symmetric absmax per group), ``fp16``/``bf16``/``fp32`` passthrough, ``lora``
(LoRA factors kept as factors; Hu et al. 2022, arXiv:2106.09685) and ``auto`` (smallest encoding per
tensor within a relative-error bound). Scales are stored as float32, bfloat16 or ``log8`` (one float32
reference per tensor and one byte per group on a 1/16-octave grid, see ``logscale``: BitDelta with
groups of 128 at 1.0625 bits per weight). The payload format is explicit (see ``container``), never
pickle; every decoder validates the header before it allocates and raises :class:`CodecError`.
"""

from zoo_gym.codec.api import (
    DEFAULT_MAX_ELEMENTS,
    decode,
    decode_factors,
    decode_rows,
    decode_tensor,
    encode,
    read_bitdelta,
    read_manifest,
    relative_error,
    sent_sq_norm,
    sha256_hex,
)
from zoo_gym.codec.bitdelta import BitDeltaPacked
from zoo_gym.codec.container import FORMAT_VERSION, Manifest, TensorEntry
from zoo_gym.codec.errors import CodecError
from zoo_gym.codec.layout import CODECS
from zoo_gym.codec.lora import LoraFactors

__all__ = [
    "BitDeltaPacked",
    "CODECS",
    "CodecError",
    "DEFAULT_MAX_ELEMENTS",
    "FORMAT_VERSION",
    "LoraFactors",
    "Manifest",
    "TensorEntry",
    "decode",
    "decode_factors",
    "decode_rows",
    "decode_tensor",
    "encode",
    "read_bitdelta",
    "read_manifest",
    "relative_error",
    "sent_sq_norm",
    "sha256_hex",
]
