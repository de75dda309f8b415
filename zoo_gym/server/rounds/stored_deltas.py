"""`StoredDeltas`: the DeltaSource over a round's stored payloads (memory-mapped blobs), tensor by tensor,
with a bounded cache of decoded rows, LoRA norms from the factors, and row blocks for the Ray engine."""

from __future__ import annotations

import math

import torch

from zoo_gym import codec


class StoredDeltas:
    """DeltaSource over a round's stored payloads (zoo_gym.aggregation.DeltaSource).

    DeltaSoup reads every tensor in more than one pass (validate, distances, aggregate). Decoded rows are
    kept in a cache bounded by `cache_bytes`, so small models are decoded once while a model larger
    than the budget still streams one tensor x n at a time. LoRA-coded tensors are validated from their
    factors (`sq_norms`), so a mean decodes each of them once.
    """

    def __init__(self, payloads: list, contributors: list[str], shapes: dict[str, tuple[int, ...]], *,
                 cache_bytes: int = 512 << 20) -> None:
        self.contributors = contributors
        self._cache: dict[str, torch.Tensor] = {}
        self._cache_left = cache_bytes
        self._vouched: dict[str, torch.Tensor] = {}  # sq_norms of tensors sent as safe float32 LoRA factors
        self._payloads = payloads
        self._shapes = shapes  # the base's tensors, in its file order
        self._manifests = [codec.read_manifest(p) for p in payloads]  # parsed once, passed to every decode
        self._entries = [{e.name: e for e in m.entries} for m in self._manifests]
        names = set().union(*(set(e) for e in self._entries)) if self._entries else set()
        self._names = [n for n in shapes if n in names]  # base order: deterministic

    def names(self) -> list[str]:
        return self._names

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._shapes[name])

    def stacked(self, name: str) -> torch.Tensor:
        if name in self._cache:
            return self._cache[name]
        out = torch.empty((len(self._payloads), math.prod(self._shapes[name])))  # (n, numel), decoded in place
        for i, row in enumerate(out):
            self._decode_row(i, name, row)
        if out.nbytes <= self._cache_left:
            self._cache[name] = out
            self._cache_left -= out.nbytes
        return out

    def _decode_row(self, i: int, name: str, row: torch.Tensor) -> None:
        """Contributor i's tensor `name` decoded into `row` ((numel,) float32; zeros when it did not send it)."""
        shape = tuple(self._shapes[name])
        payload, manifest, e = self._payloads[i], self._manifests[i], self._entries[i].get(name)
        if e is None:  # this contributor did not change the tensor (e.g. LoRA leaves norms alone)
            row.zero_()
        elif e.codec == "lora" and e.dtype == "float32" and tuple(e.shape) == shape:
            codec.decode_factors(payload, name, manifest=manifest).merged(out=row.view(shape))  # one matmul
        else:
            row.copy_(codec.decode_tensor(payload, name, manifest=manifest).reshape(-1))

    def stacked_block(self, name: str, start: int, stop: int) -> torch.Tensor:
        """(n, stop - start) float32: elements [start, stop) of `stacked(name)`'s rows, the same numbers. Each
        contributor's tensor is decoded whole into one scratch row (codecs have no range decode yet), so memory
        is the block x n plus one tensor; nothing is cached."""
        if name in self._cache:
            return self._cache[name][:, start:stop]
        scratch = torch.empty(math.prod(self._shapes[name]))
        out = torch.empty((len(self._payloads), stop - start))
        for i in range(len(self._payloads)):
            self._decode_row(i, name, scratch)
            out[i].copy_(scratch[start:stop])
        return out

    def sq_norms(self, name: str) -> tuple[torch.Tensor, int] | None:
        """((n,) float64 squared L2 norms of the rows `stacked(name)` returns, numel) from LoRA factors
        alone (r x r Gram matrices, `LoraFactors.merged_sq_norm`): DeltaSoup's validation needs no decode.
        None unless every contributor that sent the tensor sent float32 LoRA factors the norm is safe
        from (then DeltaSoup decodes). A cached tensor is not decoded again either way; norms already
        taken are returned again without recomputing them."""
        if name in self._vouched:
            return self._vouched[name], math.prod(self._shapes[name])
        if name in self._cache:
            return None
        out = torch.zeros(len(self._payloads), dtype=torch.float64)  # (n,)
        for i, (payload, entries, manifest) in enumerate(zip(self._payloads, self._entries, self._manifests)):
            e = entries.get(name)
            if e is None:
                continue  # did not change the tensor: a zero row
            if e.codec != "lora" or e.dtype != "float32":
                return None
            sq = codec.decode_factors(payload, name, manifest=manifest).merged_sq_norm()
            if sq is None:
                return None
            out[i] = sq
        self._vouched[name] = out
        return out, math.prod(self._shapes[name])

    def factors(self, name: str) -> list | None:
        """Each contributor's LoraFactors of `name` (None: it did not send the tensor), for a tensor whose
        norms `sq_norms` vouched for (finite, no overflow, no cancellation); else None (rows are decoded)."""
        if name not in self._vouched:
            return None
        shape = tuple(self._shapes[name])
        out = []
        for payload, entries, manifest in zip(self._payloads, self._entries, self._manifests):
            e = entries.get(name)
            if e is not None and tuple(e.shape) != shape:
                return None
            out.append(None if e is None else codec.decode_factors(payload, name, manifest=manifest))
        return out

    def stacked_one(self, i: int, name: str) -> torch.Tensor:
        """Contributor i's delta for one tensor, in the base's shape (zeros when it did not send it)."""
        if name in self._entries[i]:
            return codec.decode_tensor(self._payloads[i], name, manifest=self._manifests[i]).reshape(
                self._shapes[name]).float()
        return torch.zeros(self._shapes[name])

    def packed(self, name: str):
        if not all(name in e and e[name].codec == "bitdelta" for e in self._entries):
            return None
        return [codec.read_bitdelta(p, name, manifest=m) for p, m in zip(self._payloads, self._manifests)]
