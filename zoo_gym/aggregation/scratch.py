"""`Scratch`: one float32 buffer lent again and again, grown to the largest size asked for.

A large round reads every tensor in blocks, pass after pass; a fresh buffer per block is mapped and faulted in
each time (the server keeps large buffers out of its heap, allocator.py), so the readers lend one instead.
Whoever borrows it uses what it holds before asking for the next.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


class Scratch:
    def __init__(self) -> None:
        self._buf = torch.empty(0)

    def get(self, *shape: int) -> Tensor:
        """A float32 tensor of `shape` over the buffer (its contents are whatever the last borrower left)."""
        numel = math.prod(shape)
        if self._buf.numel() < numel:
            self._buf = torch.empty(0)  # the old one goes before the new one is made
            self._buf = torch.empty(numel)
        return self._buf[:numel].view(shape)
