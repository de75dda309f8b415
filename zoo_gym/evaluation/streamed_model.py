"""A causal LM whose decoder layers are read from its checkpoint one at a time, in float32.

``load_streamed(model_dir)`` returns the Hugging Face model of ``model_dir`` with only its small parameters
(norms) resident; the embedding and output layer are mapped from the file and used a vocabulary block at a
time (``vocab_blocks.py``); each decoder layer reads its weights from the safetensors file when its forward
starts and drops them when the next layer loads (or when its forward ends outside a backward), while a
reader thread reads the next layer of a forward. With grad enabled every layer runs under non-reentrant
activation checkpointing and the backward's recompute loads the layer again, so a gradient pass
(``gradient.base_gradient``) holds one layer's weights at a time (two in its forward). Losses and gradients are
the whole-model ones. ``model.zoo_stream.applied(delta, scale=c)`` evaluates base + ``c * delta``.
Why and how: docs/design/streamed-evaluation.md.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pathlib
import warnings
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch.utils.checkpoint import checkpoint

from zoo_gym.evaluation.memory import trim_heap
from zoo_gym.io.safetensors_reader import SafetensorsReader, WeightsFile

from .activation_budget import decoder_layers
from .vocab_blocks import install

_TRIM = os.environ.get("ZOO_GYM_STREAM_TRIM", "1") != "0"
_PREFETCH = os.environ.get("ZOO_GYM_STREAM_PREFETCH", "1") != "0"  # 0: read each layer when it is needed

WEIGHTS = "model.safetensors"


_POPULATE_READ = 22  # Linux 5.14+: map a range's pages in now, reading them from disk if needed


def _advise(mm: mmap.mmap, advice: int, start: int, n: int) -> None:
    a = start // mmap.PAGESIZE * mmap.PAGESIZE
    try:
        mm.madvise(advice, a, min(len(mm), start + n) - a)
    except OSError:  # an older kernel without MADV_POPULATE_READ: the compute's first touch maps the pages
        if advice != _POPULATE_READ:
            raise


def _absent(shape: torch.Size) -> torch.Tensor:
    """What an unloaded parameter holds: the right shape, one float of storage, NaN (a stray use shows)."""
    return torch.full((), float("nan"), dtype=torch.float32).expand(shape)


class LayerStream:
    """Loads and drops the decoder layers' weights of one model; counts what is resident."""

    def __init__(self, model: torch.nn.Module, weights: WeightsFile, keys: set[str]) -> None:
        self.weights = weights
        self._keys = keys
        self._prefix = getattr(model, "base_model_prefix", "") or ""
        names = {id(m): n for n, m in model.named_modules()}
        self.layers = decoder_layers(model)
        self._layer_params = [[(f"{names[id(layer)]}.{n}", p) for n, p in layer.named_parameters()]
                              for layer in self.layers]
        self.params = dict(model.named_parameters(remove_duplicate=False))
        in_layer = {id(p) for ps in self._layer_params for _, p in ps}
        self.resident_params = {n: p for n, p in self.params.items() if id(p) not in in_layer}
        self.resident: set[int] = set()
        self.max_resident = 0   # most decoder layers in memory at once (resident + read ahead), over its life
        self.loads = 0          # layer loads (a checkpointed layer loads twice per gradient pass)
        self.loads_read_ahead = 0  # of them, loads the reader thread had read
        self._delta: Mapping | None = None
        self._scale = 1.0
        self._recomputing = False
        self.prefetch = _PREFETCH
        self._reader: ThreadPoolExecutor | None = None
        self._ahead: dict[int, tuple[Future, tuple]] = {}  # layer -> its read, for (delta, scale, dtype)
        # float32, or bfloat16: the layers' matrices read in bf16 and their products computed under autocast
        # (float32 accumulation; norms, softmax and the residual stream stay float32). `computing` sets it.
        self.compute_dtype = torch.float32
        self.vocab = None  # the model's VocabWeights (vocab_blocks.py): computes in the same dtype
        self._map: mmap.mmap | None = None  # the weights file, mapped read-only once (bf16 layers used in place)
        self._spans: dict[int, list[tuple[int, int]]] = {}  # layer -> the mapped byte ranges it uses

    def key(self, name: str) -> str:
        """The checkpoint's key of parameter ``name`` (with or without the base model's prefix)."""
        if name in self._keys:
            return name
        short = name.removeprefix(self._prefix + ".") if self._prefix else name
        for k in (short, f"{self._prefix}.{name}"):
            if k in self._keys:
                return k
        raise KeyError(f"the checkpoint {self.weights.path} has no tensor for parameter {name!r}")

    def has(self, name: str) -> bool:
        try:
            self.key(name)
        except KeyError:
            return False
        return True

    def read(self, reader: SafetensorsReader, name: str, delta: Mapping | None = None,
             scale: float = 1.0) -> torch.Tensor:
        with torch.inference_mode(False):  # ordinary tensors: a gradient pass may save them
            if self.compute_dtype is not torch.float32 and self.params[name].dim() >= 2:
                return reader.read_as(self.key(name), self.compute_dtype)
            t = reader.read_as(self.key(name), torch.float32)
            if delta is not None and name in delta:
                t = torch.add(t, _dense(delta[name]).to(torch.float32), alpha=scale)
        return t

    def _read_layer(self, i: int, delta: Mapping | None,
                    scale: float) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
        """Layer ``i``'s tensors, and the file ranges of those used in place (none in float32)."""
        with self.weights.open() as reader:  # each tensor converted from a map unmapped at once: no mapped pages stay
            if self.compute_dtype is torch.float32:
                return [self.read(reader, name, delta, scale) for name, _ in self._layer_params[i]], []
            return self._in_place(reader, i)

    def _in_place(self, reader: SafetensorsReader, i: int) -> tuple[list[torch.Tensor], list[tuple[int, int]]]:
        """Computing in the dtype the matrices are stored in: they are used where they lie in the page cache,
        through a read-only mapping whose pages are mapped in here (on the reader thread) and dropped from the
        process again when the layer is (``evict``); no copy. The other tensors as ``read`` gives them."""
        if self._map is None:
            with open(self.weights.path, "rb") as f:
                self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        out, spans = [], []
        with torch.inference_mode(False):
            for name, p in self._layer_params[i]:
                info = reader.infos[self.key(name)]
                if p.dim() < 2 or info.torch_dtype != self.compute_dtype:
                    out.append(self.read(reader, name))
                    continue
                with warnings.catch_warnings():  # read-only: nothing writes into a weight in place
                    warnings.simplefilter("ignore", UserWarning)
                    flat = torch.frombuffer(self._map, dtype=info.torch_dtype, offset=info.start,
                                            count=info.nbytes // info.torch_dtype.itemsize)
                _advise(self._map, _POPULATE_READ, info.start, info.nbytes)
                out.append(flat.view(info.shape))
                spans.append((info.start, info.nbytes))
        return out, spans

    def _read_ahead(self, i: int) -> None:
        """Start reading layer ``i`` on the reader thread (torch and file reads release the GIL)."""
        if not self.prefetch or not 0 <= i < len(self.layers) or i in self.resident or i in self._ahead:
            return
        if self._reader is None:
            self._reader = ThreadPoolExecutor(1, thread_name_prefix="zoo-gym-layer-reader")
        self._ahead[i] = (self._reader.submit(self._read_layer, i, self._delta, self._scale), self._reading())

    def _reading(self) -> tuple:
        return self._delta, self._scale, self.compute_dtype

    def load(self, i: int) -> None:
        """Make layer ``i`` resident (every other layer is dropped first) and start reading the next one."""
        for j in list(self.resident):
            if j != i:
                self.evict(j)
        if i in self.resident:
            return
        ahead = self._ahead.pop(i, None)
        if ahead is not None and all(a is b or a == b for a, b in zip(ahead[1], self._reading(), strict=True)):
            tensors, spans = ahead[0].result()
            self.loads_read_ahead += 1
        else:
            tensors, spans = self._read_layer(i, self._delta, self._scale)
        for (_, p), t in zip(self._layer_params[i], tensors, strict=True):
            p.data = t
        self._spans[i] = spans
        del tensors, ahead
        self.resident.add(i)
        self.loads += 1
        if not self._recomputing:  # a backward's recomputes read what its forward just read: from the page
            self._read_ahead(i + 1)  # cache, so a reader would only take the compute's CPU (measured, see doc)
        self.max_resident = max(self.max_resident, len(self.resident) + len(self._ahead))

    def _drop_ahead(self) -> None:
        for future, _ in self._ahead.values():
            future.cancel()
        self._ahead.clear()

    def evict(self, i: int) -> None:
        for _, p in self._layer_params[i]:
            p.data = _absent(p.shape)
        self.resident.discard(i)
        for start, n in self._spans.pop(i, ()):  # a file mapping: the pages stay in the page cache, and a view
            _advise(self._map, mmap.MADV_DONTNEED, start, n)  # autograd still holds maps them again on use
        if _TRIM:
            trim_heap()  # the layer's tensors sit below malloc's mmap threshold: hand their pages back

    def evict_all(self) -> None:
        self._drop_ahead()
        for i in list(self.resident):
            self.evict(i)

    @contextlib.contextmanager
    def recomputing(self) -> Iterator[None]:
        """The backward's recompute of a checkpointed layer: its weights stay for that layer's backward."""
        before, self._recomputing = self._recomputing, True
        try:
            yield
        finally:
            self._recomputing = before

    def wrap(self, i: int) -> None:
        """Layer ``i``'s forward loads it, runs it (checkpointed when grad is on) and drops it after."""
        layer = self.layers[i]
        forward = layer.forward

        def run(*args, **kwargs):
            self.load(i)
            low = self.compute_dtype is not torch.float32
            with torch.autocast("cpu", dtype=self.compute_dtype, enabled=low):
                out = forward(*args, **kwargs)
            if not self._recomputing:
                self.evict(i)
            return out

        def streamed(*args, **kwargs):
            if torch.is_grad_enabled():
                return checkpoint(run, *args, use_reentrant=False,
                                  context_fn=lambda: (contextlib.nullcontext(), self.recomputing()), **kwargs)
            return run(*args, **kwargs)

        layer.forward = streamed  # an instance attribute: nn.Module calls it first

    @contextlib.contextmanager
    def computing(self, dtype: torch.dtype) -> Iterator[None]:
        """Within the block the layers compute in ``dtype`` (float32 or bfloat16; a delta applied inside
        computes in float32: its effect is below a bf16 weight's rounding)."""
        if dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"a streamed model computes in float32 or bfloat16, not {dtype}")
        before = self.compute_dtype
        self.evict_all()
        self._set_dtype(dtype)
        try:
            yield
        finally:
            self.evict_all()
            self._set_dtype(before)

    def _set_dtype(self, dtype: torch.dtype) -> None:
        self.compute_dtype = dtype
        if self.vocab is not None:
            self.vocab.compute_dtype = dtype

    @contextlib.contextmanager
    def applied(self, delta: Mapping | None, *, scale: float = 1.0) -> Iterator[None]:
        """Within the block the model computes with base + ``scale * delta``: decoder layers add it as
        they load, resident parameters get it now and their base values back after."""
        delta = delta or {}
        for name in delta.keys():
            p = self.params.get(name)
            if p is None:
                raise KeyError(f"delta names {name!r}, which is not a parameter of the model")
            d = _dense(delta[name])
            if tuple(d.shape) != tuple(p.shape):
                raise ValueError(f"delta {name!r} has shape {tuple(d.shape)}, the model's is {tuple(p.shape)}")
        saved: dict[int, tuple[torch.nn.Parameter, torch.Tensor]] = {}
        self.evict_all()
        self._delta, self._scale = delta, scale
        dtype = self.compute_dtype
        if delta:  # a delta's effect is below a bf16 weight's rounding: base + delta computes in float32
            self._set_dtype(torch.float32)
        try:
            with torch.no_grad():
                for name, p in self.resident_params.items():
                    if name in delta and id(p) not in saved:
                        saved[id(p)] = (p, p.data)
                        # float32 even for a weight kept in the checkpoint's dtype (vocab_blocks.py)
                        p.data = torch.add(p.data.to(torch.float32), _dense(delta[name]).to(torch.float32),
                                           alpha=scale)
            yield
        finally:
            self.evict_all()
            self._delta, self._scale = None, 1.0
            self._set_dtype(dtype)
            for p, orig in saved.values():
                p.data = orig


def _dense(value) -> torch.Tensor:
    from zoo_gym.evaluation.evaluate import dense_delta

    return dense_delta(value)


def load_streamed(model_dir: str | pathlib.Path, weights: WeightsFile | None = None) -> torch.nn.Module:
    """The float32 model of ``model_dir`` (its config; its weights a single ``model.safetensors``) with
    streamed decoder layers. ``weights``: read them from there instead, e.g. in place from a checkpoint
    archive (``WeightsFile.in_archive``), so the directory needs no copy of them."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    model_dir = pathlib.Path(model_dir)
    weights = weights or WeightsFile(model_dir / WEIGHTS)
    config = AutoConfig.from_pretrained(str(model_dir))
    with init_empty_weights():  # parameters on the meta device; buffers (rotary tables) computed as usual
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.tie_weights()
    fresh: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():  # meta parameters -> CPU placeholders (one Parameter per tied weight)
        for n, p in list(module._parameters.items()):  # noqa: SLF001 - replacing them in place
            if p is not None:
                fresh.setdefault(id(p), torch.nn.Parameter(_absent(p.shape), requires_grad=p.requires_grad))
                module._parameters[n] = fresh[id(p)]  # noqa: SLF001
    # embedding and output layer: mapped from the file in its dtype, used (and handed back) a vocabulary block at a time
    vocab = install(model)
    in_vocab = {id(vocab.embed.weight), id(vocab.head.weight)} if vocab is not None else set()
    with weights.open() as reader:
        keys = set(reader.names())
        stream = LayerStream(model, weights, keys)
        aliases: dict[int, list[str]] = {}
        for name, p in stream.resident_params.items():
            aliases.setdefault(id(p), []).append(name)
        for key, names in aliases.items():  # a tied weight is stored under one of its names
            stored = [n for n in names if stream.has(n)] or names
            p, name = stream.resident_params[stored[0]], stored[0]
            p.data = vocab.map(weights, stream.key(name)) if key in in_vocab else stream.read(reader, name)
    stream.vocab = vocab
    for i in range(len(stream.layers)):
        stream.wrap(i)
    embed = model.get_input_embeddings()
    if vocab is None and isinstance(embed, torch.nn.Embedding):  # its gradient as the rows it saw, added in
        embed.sparse = True  # place into the tied output layer's buffer instead of a second (vocab, hidden) one
    model.zoo_stream = stream
    model.eval()
    return model


def compute_dtype(setting: str) -> torch.dtype:
    """The dtype of a streamed pass for the setting ``auto``, ``float32`` or ``bfloat16`` (``ServerConfig.
    evaluation_dtype``): auto is bfloat16 where the CPU multiplies bf16 natively (AVX512-BF16 or AMX), else float32
    (oneDNN emulates bf16 there, slower than float32)."""
    if setting == "auto":
        native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()  # noqa: SLF001
        return torch.bfloat16 if native else torch.float32
    if setting not in ("float32", "bfloat16"):
        raise ValueError(f"evaluation dtype must be auto, float32 or bfloat16, got {setting!r}")
    return getattr(torch, setting)


@contextlib.contextmanager
def computing(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[None]:
    """``LayerStream.computing`` for a streamed model; float32 only for any other model."""
    stream = stream_of(model)
    if stream is None:
        if dtype is not torch.float32:
            raise ValueError(f"only a streamed model (load_streamed) computes in {dtype}")
        yield
        return
    with stream.computing(dtype):
        yield


def stream_of(model: torch.nn.Module) -> LayerStream | None:
    """The model's ``LayerStream`` when it was loaded by ``load_streamed``, else None."""
    return getattr(model, "zoo_stream", None)
