"""Builders shared by the aggregation tests (BitDelta packing through the real codec)."""

from __future__ import annotations

import numpy as np
import torch

from zoo_gym.codec.bitdelta import BitDeltaPacked, pack_bitdelta
from zoo_gym.codec.layout import groups_for


def make_packed(x: torch.Tensor, *, group_size: int | None) -> BitDeltaPacked:
    """BitDelta-pack a (rows, cols) float32 tensor with the codec's own packer."""
    rows, cols = x.shape
    groups = groups_for(rows=rows, cols=cols, group_size=group_size, codec="bitdelta")
    signs, scales = pack_bitdelta(x, groups=groups)
    scales = np.broadcast_to(scales.astype(np.float32), (rows, groups.n_groups)).copy()
    return BitDeltaPacked(shape=(rows, cols), rows=rows, cols=cols, group_size=groups.size,
                          signs=torch.from_numpy(signs), scales=torch.from_numpy(scales))
