"""A streamed model's vocabulary-sized weights (input embedding, output layer) kept in the checkpoint's dtype
and used ``BLOCK_ROWS`` vocabulary rows at a time, upcast to float32 per block.

``install(model)`` replaces the forwards of the embedding and the bias-free linear output layer: the embedding
gathers rows in float32; the output layer computes float32 logits block by block, or, called as
``head(hidden, targets=t)``, the summed cross-entropy with a running logsumexp (``head_loss_sum``: never a
``(K, vocab)`` tensor). Gradients do not go to ``.grad``: each backward records its pieces (hidden states and
logsumexps, gathered rows) in the ``VocabGradient`` that ``gathering()`` opens, and ``VocabGradient.finish`` hands
out each weight's float32 gradient a block of rows at a time (head part plus the embedding rows in that block),
so no ``(vocab, hidden)`` gradient is ever built. Why and how: docs/design/streamed-evaluation.md.
"""

from __future__ import annotations

import contextlib
import mmap
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from zoo_gym.evaluation.evaluate import hidden_at
from zoo_gym.io.safetensors_reader import WeightsFile

BLOCK_ROWS = 8192  # vocabulary rows per block: (rows, hidden) float32 weights, (K, rows) logits


def _rows(vocab: "VocabWeights", w: Tensor, v0: int, v1: int) -> Tensor:
    """Rows v0:v1 in the compute dtype (a copy); a mapped weight's pages of those rows leave the RSS again."""
    m = vocab.mapping(w)
    if m is None:
        return w[v0:v1].to(vocab.compute_dtype)                           # (Vb, H)
    out = w[v0:v1].to(vocab.compute_dtype, copy=True)                    # (Vb, H), off the mapping
    m.drop(v0, v1)
    return out


def _mm(vocab: "VocabWeights", a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` in the compute dtype (bf16: float32 accumulation, the product rounded once), as float32."""
    if vocab.compute_dtype is torch.float32:
        return a @ b
    return (a.to(vocab.compute_dtype) @ b.to(vocab.compute_dtype)).float()


class _MappedWeight:
    """A 2-D tensor of a safetensors file, mapped read-only: pages it reads are file pages, and ``drop`` hands a
    range of rows back to the page cache (``MADV_DONTNEED`` on a shared read-only file mapping loses nothing)."""

    def __init__(self, weights: WeightsFile, key: str) -> None:
        with weights.open() as reader:
            info = reader.infos[key]
        with open(weights.path, "rb") as f:
            self.mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        dtype = info.torch_dtype
        with warnings.catch_warnings():  # read-only buffer: nothing ever writes into a weight in place
            warnings.simplefilter("ignore", UserWarning)
            flat = torch.frombuffer(self.mm, dtype=dtype, offset=info.start, count=info.nbytes // dtype.itemsize)
        self.tensor = flat.view(*info.shape)
        self.offset, self.row_bytes = info.start, self.tensor[0].numel() * dtype.itemsize

    def drop(self, v0: int = 0, v1: int | None = None) -> None:
        v1 = self.tensor.shape[0] if v1 is None else v1
        a = (self.offset + v0 * self.row_bytes) // mmap.PAGESIZE * mmap.PAGESIZE
        b = min(len(self.mm), self.offset + v1 * self.row_bytes)
        self.mm.madvise(mmap.MADV_DONTNEED, a, b - a)


def _capped(z: Tensor, cap: float | None) -> Tensor:
    return torch.tanh(z / cap) * cap if cap else z


def _dlogits(vocab: "VocabWeights", h: Tensor, w: Tensor, v0: int, v1: int, lse: Tensor, targets: Tensor,
             cap: float | None, scale: Tensor) -> Tensor:
    """d(sum CE)/d(logits) of vocabulary rows v0:v1, times ``scale``: (K, Vb) float32. A vocabulary of one
    block takes ``softmax`` itself: the very operations of ``evaluation.head_loss``, bit for bit."""
    logits = _capped(_mm(vocab, h, _rows(vocab, w, v0, v1).T), cap)      # (K, Vb)
    whole = v0 == 0 and v1 == w.shape[0]
    d = torch.softmax(logits, dim=-1) if whole else torch.exp(logits - lse[:, None])  # softmax rows v0:v1
    hit = (targets >= v0) & (targets < v1)                                # (K,)
    d[hit.nonzero()[:, 0], targets[hit] - v0] -= 1.0
    d *= scale
    if cap:  # through tanh(z / cap) * cap
        d *= 1.0 - (logits / cap) ** 2
    return d


@dataclass
class _HeadPart:
    """One backward's output-layer gradient, as factors: sum over positions of dlogits^T @ h."""
    h: Tensor                       # (K, H) float32
    dlogits: Callable[[int, int], Tensor]  # (v0, v1) -> (K, v1 - v0) float32


class VocabGradient:
    """The vocabulary weights' gradient, gathered from backward passes and finished a block at a time."""

    def __init__(self, vocab: "VocabWeights") -> None:
        self.vocab = vocab
        self.head: list[_HeadPart] = []
        self.ids: list[Tensor] = []    # (N,) long, embedding rows used
        self.rows: list[Tensor] = []   # (N, H) float32, their gradients

    def finish(self, head_param: torch.nn.Parameter, embed_param: torch.nn.Parameter,
               put: Callable[[torch.nn.Parameter, Iterator[Tensor]], None]) -> None:
        """``put(param, blocks)`` for the output layer's and the embedding's weight (once when tied): ``blocks``
        yields the float32 gradient of rows ``[0, B)``, ``[B, 2B)``, ... in order."""
        ids = torch.cat(self.ids) if self.ids else torch.zeros(0, dtype=torch.long)          # (N,)
        rows = torch.cat(self.rows) if self.rows else torch.zeros(0, head_param.shape[1])   # (N, H)
        tied = head_param is embed_param
        put(head_param, self._blocks(head_param.shape, head=True, ids=ids if tied else None, rows=rows))
        if not tied:
            put(embed_param, self._blocks(embed_param.shape, head=False, ids=ids, rows=rows))
        self.head, self.ids, self.rows = [], [], []

    def _blocks(self, shape, *, head: bool, ids: Tensor | None, rows: Tensor) -> Iterator[Tensor]:
        V, H = shape
        for v0 in range(0, V, BLOCK_ROWS):
            v1 = min(V, v0 + BLOCK_ROWS)
            g = torch.zeros(v1 - v0, H, dtype=torch.float32)              # (Vb, H)
            if head:
                for part in self.head:
                    if self.vocab.compute_dtype is torch.float32:
                        g.addmm_(part.dlogits(v0, v1).T, part.h)
                    else:
                        g += _mm(self.vocab, part.dlogits(v0, v1).T, part.h)
            if ids is not None:
                sel = ((ids >= v0) & (ids < v1)).nonzero()[:, 0]
                g.index_add_(0, ids[sel] - v0, rows[sel])
            yield g


class VocabWeights:
    """The embedding and output layer a streamed model computes block by block; ``grad`` while gathering."""

    def __init__(self, embed: torch.nn.Embedding, head: torch.nn.Linear) -> None:
        self.embed, self.head = embed, head
        self.grad: VocabGradient | None = None
        self._mapped: dict[int, _MappedWeight] = {}  # data_ptr -> mapping; they live as long as the model
        self.compute_dtype = torch.float32  # the products' dtype (the stream's: LayerStream.computing)

    def map(self, weights: WeightsFile, key: str) -> Tensor:
        """Tensor ``key`` of the safetensors bytes ``weights``, mapped (``_MappedWeight``), in their dtype."""
        m = _MappedWeight(weights, key)
        self._mapped[m.tensor.data_ptr()] = m
        return m.tensor

    def mapping(self, w: Tensor) -> _MappedWeight | None:
        """The mapping ``w`` is, or None (an ordinary tensor, e.g. base + delta swapped in)."""
        m = self._mapped.get(w.data_ptr())
        return m if m is not None and m.tensor.shape == w.shape else None

    @contextlib.contextmanager
    def gathering(self) -> Iterator[VocabGradient]:
        """Backward passes within the block record the vocabulary weights' gradient here."""
        before, self.grad = self.grad, VocabGradient(self)
        try:
            yield self.grad
        finally:
            self.grad = before

    def _gradient(self) -> VocabGradient:
        if self.grad is None:
            raise RuntimeError("a streamed model's embedding and output layer take gradients only inside "
                               "VocabWeights.gathering() (evaluation.gradient.base_gradient opens it)")
        return self.grad


class _Embed(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: Tensor, weight: Tensor, vocab: VocabWeights) -> Tensor:
        ctx.vocab = vocab
        ctx.save_for_backward(ids)
        out = weight[ids].float()                                         # (..., H) float32
        m = vocab.mapping(weight)
        if m is not None:
            m.drop()
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (ids,) = ctx.saved_tensors
        flat, g = ids.reshape(-1), grad_out.reshape(-1, grad_out.shape[-1]).float()   # (N,), (N, H)
        pad = ctx.vocab.embed.padding_idx
        if pad is not None:  # nn.Embedding leaves the padding row's gradient at zero
            keep = flat != pad
            flat, g = flat[keep], g[keep]
        grad = ctx.vocab._gradient()  # noqa: SLF001 - the module's own accessor
        grad.ids.append(flat.clone())
        grad.rows.append(g.clone())
        return None, None, None


class _Logits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, vocab: VocabWeights) -> Tensor:
        w = weight.detach()
        out = torch.empty(*h.shape[:-1], w.shape[0], dtype=torch.float32)  # (..., V)
        flat = out.view(-1, w.shape[0])
        hf = h.reshape(-1, h.shape[-1]).float()
        for v0 in range(0, w.shape[0], BLOCK_ROWS):
            v1 = min(w.shape[0], v0 + BLOCK_ROWS)
            flat[:, v0:v1] = _mm(vocab, hf, _rows(vocab, w, v0, v1).T)
        ctx.vocab, ctx.w = vocab, w
        ctx.save_for_backward(h)
        return out

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        (h,) = ctx.saved_tensors
        w, V = ctx.w, ctx.w.shape[0]
        hf = h.reshape(-1, h.shape[-1]).float().detach()                  # (K, H)
        g = grad_out.reshape(-1, V).float()                               # (K, V)
        grad_h = torch.zeros_like(hf)
        for v0 in range(0, V, BLOCK_ROWS):
            v1 = min(V, v0 + BLOCK_ROWS)
            grad_h += _mm(ctx.vocab, g[:, v0:v1], _rows(ctx.vocab, w, v0, v1))
        ctx.vocab._gradient().head.append(_HeadPart(hf, lambda a, b: g[:, a:b]))  # noqa: SLF001
        return grad_h.reshape(h.shape).to(h.dtype), None, None


class _CrossEntropySum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, weight: Tensor, targets: Tensor, cap: float | None, vocab: VocabWeights) -> Tensor:
        w = weight.detach()
        hf = h.float()                                                    # (K, H)
        lse = torch.full((h.shape[0],), float("-inf"), dtype=torch.float32)  # running logsumexp (K,)
        picked = torch.zeros(h.shape[0], dtype=torch.float32)             # target logits (K,)
        total = None
        for v0 in range(0, w.shape[0], BLOCK_ROWS):
            v1 = min(w.shape[0], v0 + BLOCK_ROWS)
            logits = _capped(_mm(vocab, hf, _rows(vocab, w, v0, v1).T), cap)  # (K, Vb)
            if v1 - v0 == w.shape[0]:  # one block: the plain cross-entropy (evaluation.head_loss's numbers)
                total = torch.nn.functional.cross_entropy(logits, targets, reduction="sum")
                break
            lse = torch.logaddexp(lse, torch.logsumexp(logits, dim=1))
            hit = ((targets >= v0) & (targets < v1)).nonzero()[:, 0]
            picked[hit] = logits[hit, targets[hit] - v0]
        ctx.vocab, ctx.w, ctx.cap = vocab, w, cap
        ctx.save_for_backward(h, targets, lse)
        return total if total is not None else (lse - picked).sum()

    @staticmethod
    def backward(ctx, grad_total: Tensor):
        h, targets, lse = ctx.saved_tensors
        vocab, w, cap, V = ctx.vocab, ctx.w, ctx.cap, ctx.w.shape[0]
        hf, scale = h.float().detach(), grad_total.detach().float()
        grad_h = torch.zeros_like(hf)                                     # (K, H)
        for v0 in range(0, V, BLOCK_ROWS):
            v1 = min(V, v0 + BLOCK_ROWS)
            grad_h += _mm(vocab, _dlogits(vocab, hf, w, v0, v1, lse, targets, cap, scale), _rows(vocab, w, v0, v1))
        vocab._gradient().head.append(  # noqa: SLF001 - recomputed block by block when finished
            _HeadPart(hf, lambda a, b: _dlogits(vocab, hf, w, a, b, lse, targets, cap, scale)))
        return grad_h.to(h.dtype), None, None, None, None


def install(model: torch.nn.Module) -> VocabWeights | None:
    """Route ``model``'s embedding and output layer through the blocked functions above (weights read from the
    parameters at call time, so a delta swapped into ``.data`` counts); None, and nothing changed, when the
    embedding is not a plain ``nn.Embedding`` or the output layer not a bias-free ``nn.Linear``."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    if type(embed) is not torch.nn.Embedding or type(head) is not torch.nn.Linear or head.bias is not None:
        return None
    if embed.max_norm is not None or embed.scale_grad_by_freq or embed.sparse:
        return None
    vocab = VocabWeights(embed, head)

    def embed_forward(ids: Tensor) -> Tensor:
        return _Embed.apply(ids, embed.weight, vocab)

    def head_forward(h: Tensor, targets: Tensor | None = None, cap: float | None = None) -> Tensor:
        if targets is None:
            return _Logits.apply(h, head.weight, vocab)
        return _CrossEntropySum.apply(h, head.weight, targets, cap, vocab)

    embed.forward, head.forward = embed_forward, head_forward  # instance attributes: nn.Module calls them
    model.zoo_vocab = vocab
    return vocab


def vocab_of(model: torch.nn.Module) -> VocabWeights | None:
    return getattr(model, "zoo_vocab", None)


def head_loss_sum(model: torch.nn.Module, inputs: dict, *, at: Tensor, targets: Tensor) -> Tensor:
    """``evaluation.evaluate.head_loss_sum`` for an installed model: the decoder body on ``inputs``, then the
    summed cross-entropy of ``targets`` at flat positions ``at`` through one call of the output layer (so
    forward hooks on it, such as ``PackedScoringSet``'s delta swap, see the computation)."""
    head = model.get_output_embeddings()
    hidden = hidden_at(model, inputs, at)                                 # (K, H)
    cap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)
    return head(hidden, targets=targets, cap=cap)
