"""float32 scales of a served variant from what it holds: float scales, or log8 codes and their reference.

Shared by the CPU path (kernels.py) and the Triton path (kernels_triton.py), which imports no kernels.py.
"""

from __future__ import annotations

import torch
from torch import Tensor

from zoo_gym.codec.logscale import LOG8_MULT


def float_scales(scales: Tensor, ref: float | None) -> Tensor:
    """float32 scales from float scales (ref None) or from log8 codes and their reference."""
    if ref is None:
        return scales
    return torch.tensor(ref, dtype=torch.float32) * torch.from_numpy(LOG8_MULT).to(scales.device)[scales.long()]
