"""The base model's modules, patched to add each batch row's own variant delta on the fly.

Every ``nn.Linear`` / GPT-2 ``Conv1D`` / ``nn.Embedding`` of the base, and every module owning 1-D
parameters (norms), is wrapped once at server start. A forward reads ``variant_of_row`` from a shared
:class:`BatchContext`; rows whose variant has no delta for a module get the base output alone. Weight
deltas stay packed: Linear layers call ``kernels.bitdelta_linear``, Conv1D and Embedding unpack one tile
at a time. 1-D deltas are dense, and a norm recomputes its output per variant with the merged parameter,
exactly what the merged model computes. Details: docs/design/serving.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn
from torch.func import functional_call

from zoo_gym.serving.kernels import bitdelta_linear, unpack_rows
from zoo_gym.serving.variant import Variant

_TILE = 256  # packed rows unpacked at a time (Conv1D input rows, embedding lookups)


@dataclass
class BatchContext:
    """What the current forward serves: ``variants[i]`` for rows with ``variant_of_row == i`` (-1: base)."""

    variant_of_row: Tensor | None = None  # int64 (B,)
    variants: list[Variant] = field(default_factory=list)
    # per forward (keyed by the variant_of_row tensor it was computed for): every variant's rows, and the
    # slot tensors PackedLinear builds; a forward runs ~200 patched modules over the same batch
    _rows_of: Tensor | None = field(default=None, repr=False)
    _rows: list[tuple[Variant, Tensor]] = field(default_factory=list, repr=False)
    memo: dict = field(default_factory=dict, repr=False)

    def groups(self, wanted) -> list[tuple[Variant, Tensor]]:
        """(variant, its row indices) for the batch's variants that ``wanted(variant)``."""
        vr = self.variant_of_row
        if vr is None:
            return []
        if self._rows_of is not vr:
            rows = [(v, (vr == i).nonzero().squeeze(1)) for i, v in enumerate(self.variants)]
            self._rows, self._rows_of, self.memo = [(v, r) for v, r in rows if r.numel()], vr, {}
        return [(v, r) for v, r in self._rows if wanted(v)]


class _Patched(nn.Module):
    def __init__(self, base: nn.Module, ctx: BatchContext, names: dict[str, str]) -> None:
        super().__init__()
        self.base = base
        self.ctx = ctx
        self.names = names  # local parameter name -> canonical (checkpoint) name


def _add_bias(y: Tensor, groups, name: str | None) -> None:
    if name is None:
        return
    for v, rows in groups:
        db = v.dense.get(name)
        if db is not None:
            y.index_add_(0, rows, db.to(y.dtype).expand(rows.numel(), *y.shape[1:]).contiguous())


class PackedLinear(_Patched):
    """``nn.Linear`` (weight (out, in)): ``x W^T + b + (x S_v^T) * scale_v + db_v`` per row."""

    def forward(self, x: Tensor) -> Tensor:
        wname, bname = self.names["weight"], self.names.get("bias")
        groups = self.ctx.groups(lambda v: wname in v.packed or (bname is not None and bname in v.dense))
        if not groups:
            return self.base(x)
        # one kernel call per (group size, groups per row, log8 codes or float32 scales): codes are never
        # decoded here, and each PackedWeight checked itself when built (check_servable: its shape is this layer's)
        by_size: dict[tuple[int, int, bool], list[tuple[Variant, Tensor]]] = {}
        for v, rows in groups:
            pw = v.packed.get(wname)
            if pw is not None:
                key = (pw.group_size, pw.scales.shape[1], pw.scale_ref is not None)
                by_size.setdefault(key, []).append((v, rows))
        y = None
        for (gs, _, log8), members in by_size.items():
            key = tuple(id(v) for v, _ in members)
            vr = self.ctx.memo.get(key)
            if vr is None:  # slot of each row among `members` (-1: none), built once per forward
                vr = torch.full((x.shape[0],), -1, dtype=torch.long, device=x.device)
                for i, (_, rows) in enumerate(members):
                    vr[rows] = i
                self.ctx.memo[key] = vr
            pws = [v.packed[wname] for v, _ in members]
            signs = [pw.signs for pw in pws]
            scales = [pw.scales for pw in pws]  # uint8 log8 codes (decoded inside the kernel) or float32
            refs = [pw.scale_ref for pw in pws] if log8 else None
            if y is None:
                y = bitdelta_linear(x, self.base.weight, self.base.bias, signs, scales, gs, vr, scale_refs=refs,
                                    prechecked=True)
            else:  # a second group size or scale kind in one batch (rare): the delta part only
                zero = self.base.weight.new_zeros(()).expand_as(self.base.weight)
                y = y + bitdelta_linear(x, zero, None, signs, scales, gs, vr, scale_refs=refs, prechecked=True)
        if y is None:
            y = self.base(x)
        _add_bias(y, groups, bname)
        return y


class PackedConv1D(_Patched):
    """GPT-2 ``Conv1D`` (weight (in, out), ``y = x W + b``): the delta's rows are input features."""

    def forward(self, x: Tensor) -> Tensor:
        wname, bname = self.names["weight"], self.names.get("bias")
        groups = self.ctx.groups(lambda v: wname in v.packed or (bname is not None and bname in v.dense))
        y = self.base(x)
        for v, rows in groups:
            pw = v.packed.get(wname)
            if pw is None:
                continue
            xv = x.index_select(0, rows).float()  # (n, T, in)
            dv = torch.zeros(*xv.shape[:-1], pw.shape[1], dtype=torch.float32, device=x.device)
            for r0 in range(0, pw.shape[0], _TILE):
                r1 = min(pw.shape[0], r0 + _TILE)
                tile = unpack_rows(pw.signs[r0:r1], pw.scales_f32(slice(r0, r1)), cols=pw.shape[1],
                                   group_size=pw.group_size)
                dv += xv[..., r0:r1] @ tile  # (n, T, out)
            y.index_add_(0, rows, dv.to(y.dtype))
        _add_bias(y, groups, bname)
        return y


class PackedEmbedding(_Patched):
    """``nn.Embedding``: each row's looked-up vectors plus its variant's rows of the packed delta."""

    def forward(self, ids: Tensor) -> Tensor:
        wname = self.names["weight"]
        groups = self.ctx.groups(lambda v: wname in v.packed)
        y = self.base(ids)
        if not groups:
            return y
        batch = self.ctx.variant_of_row.shape[0]
        if ids.shape[0] != batch:  # e.g. position ids shared by the batch (1, T)
            ids = ids.expand(batch, *ids.shape[1:])
            y = y.expand(batch, *y.shape[1:])
        y = y.clone()
        for v, rows in groups:
            pw = v.packed[wname]
            flat = ids.index_select(0, rows).reshape(-1)  # (n*T,)
            parts = [unpack_rows(pw.signs[flat[i:i + _TILE]], pw.scales_f32(flat[i:i + _TILE]),
                                 cols=pw.shape[1], group_size=pw.group_size) for i in range(0, flat.numel(), _TILE)]
            d = torch.cat(parts).reshape(rows.numel(), *ids.shape[1:], pw.shape[1])
            scale = getattr(self.base, "embed_scale", None)  # Gemma scales what it looks up by sqrt(hidden)
            if scale is not None:
                d = d * scale.to(d.dtype) if isinstance(scale, Tensor) else d * scale
            y.index_add_(0, rows, d.to(y.dtype))
        return y


class PerRowParams(_Patched):
    """A module with 1-D parameters (a norm): rows of a variant are recomputed with ``p + dp_v``."""

    def forward(self, x: Tensor, *args, **kwargs) -> Tensor:
        canon = set(self.names.values())
        groups = self.ctx.groups(lambda v: any(n in v.dense for n in canon))
        y = self.base(x, *args, **kwargs)
        if not groups:
            return y
        y = y.clone()
        params = dict(self.base.named_parameters())
        for v, rows in groups:
            merged = {k: (p + v.dense[self.names[k]].to(p.dtype)) if self.names[k] in v.dense else p
                      for k, p in params.items()}
            y[rows] = functional_call(self.base, merged, (x.index_select(0, rows), *args), kwargs)
        return y


def _is_conv1d(m: nn.Module) -> bool:
    return type(m).__name__ == "Conv1D" and hasattr(m, "nf")


def patch_model(model: nn.Module, ctx: BatchContext) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Wrap the model's modules in place; return canonical parameter name -> (kind, shape) servable."""
    canonical = {id(p): n for n, p in model.named_parameters()}  # tied weights keep their first name
    servable: dict[str, tuple[str, tuple[int, ...]]] = {}
    targets = []
    for name, m in model.named_modules():
        own = dict(m.named_parameters(recurse=False))
        if not own:
            continue
        names = {k: canonical[id(p)] for k, p in own.items()}
        if isinstance(m, nn.Linear):
            kind = PackedLinear
        elif _is_conv1d(m):
            kind = PackedConv1D
        elif isinstance(m, nn.Embedding):
            kind = PackedEmbedding
        elif all(p.dim() == 1 for p in own.values()):
            kind = PerRowParams
        else:
            continue
        for k, p in own.items():
            packed = p.dim() == 2 and kind is not PerRowParams
            if packed or p.dim() == 1:
                servable.setdefault(names[k], ("packed" if packed else "dense", tuple(p.shape)))
        targets.append((name, kind, names))
    for name, kind, names in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, kind(getattr(parent, child), ctx, names))
    return servable


def check_servable(variant: Variant, servable: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """ValueError naming the first delta tensor this base cannot apply per row (unknown name, wrong shape)."""
    for name, pw in variant.packed.items():
        kind = servable.get(name)
        if kind is None or kind[0] != "packed" or kind[1] != pw.shape:
            raise ValueError(f"variant {variant.name!r}: {name!r} {pw.shape} is not a 2-D weight of this base's "
                             "Linear/Conv1D/Embedding layers")
    for name, t in variant.dense.items():
        kind = servable.get(name)
        if kind is None or kind[0] != "dense" or kind[1] != tuple(t.shape):
            raise ValueError(f"variant {variant.name!r}: {name!r} {tuple(t.shape)} is not a 1-D parameter "
                             "of this base")
