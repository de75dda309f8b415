"""An in-memory `DeltaSource` over per-contributor `dict[str, Tensor]` deltas (tests, notebooks,
the Flower adapter), and `SubsetSource`, some contributors of another source. The server's own source reads
mmap'd payloads instead."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .errors import InvalidDeltaError


class DictDeltaSource:
    """`deltas[i][name]` is contributor i's tensor `name`; `packed[i][name]` optional BitDelta."""

    def __init__(self, contributors: Sequence[str], deltas: Sequence[Mapping[str, Tensor]],
                 *, packed: Sequence[Mapping[str, Any]] | None = None) -> None:
        if len(contributors) != len(deltas):
            raise InvalidDeltaError(f"{len(contributors)} contributor ids but {len(deltas)} deltas")
        if not deltas:
            raise InvalidDeltaError("no deltas: a round needs at least one contribution")
        first = list(deltas[0])
        for i, d in enumerate(deltas):
            if list(d) != first:
                raise InvalidDeltaError(f"delta {i} has tensors {sorted(d)}, expected {sorted(first)}")
            for name in first:
                if d[name].shape != deltas[0][name].shape:
                    raise InvalidDeltaError(f"delta {i} tensor {name!r} has shape "
                                            f"{tuple(d[name].shape)}, expected "
                                            f"{tuple(deltas[0][name].shape)}")
        self.contributors = list(contributors)
        self._deltas = deltas
        self._packed = packed
        self._names = first

    def names(self) -> Sequence[str]:
        return list(self._names)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._deltas[0][name].shape)

    def stacked(self, name: str) -> Tensor:
        return torch.stack([d[name].reshape(-1).to(torch.float32) for d in self._deltas])

    def packed(self, name: str) -> Sequence[Any] | None:
        if self._packed is None or any(name not in p for p in self._packed):
            return None
        return [p[name] for p in self._packed]


class SubsetSource:
    """Some contributors of another source (indices `members`), read a row at a time with its
    `stacked_one(i, name)`: what the round's rule would have seen without the others (rewards scoring)."""

    def __init__(self, source: Any, members: Sequence[int]) -> None:
        if not members:
            raise InvalidDeltaError("no members: a subset needs at least one contribution")
        self._source, self._members = source, list(members)
        self.contributors = [source.contributors[i] for i in self._members]

    def names(self) -> Sequence[str]:
        return list(self._source.names())

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._source.shape(name))

    def stacked(self, name: str) -> Tensor:
        return torch.stack([self._source.stacked_one(i, name).reshape(-1).to(torch.float32) for i in self._members])

    def packed(self, name: str) -> Sequence[Any] | None:
        return None
