"""One base model serving many packed variants per forward, and batched decoding over it."""

from __future__ import annotations

import pathlib
from collections.abc import Iterator

import torch
from torch import Tensor

from zoo_gym.serving.adapted import BatchContext, check_servable, patch_model
from zoo_gym.serving.variant import Variant


class MultiVariantModel:
    """A Hugging Face causal LM whose adapted layers add each row's variant delta (see ``adapted``)."""

    def __init__(self, model, *, device: str | torch.device = "cpu") -> None:
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self.ctx = BatchContext()
        self.servable = patch_model(model, self.ctx)
        self.model = model
        self.device = torch.device(device)

    @classmethod
    def from_dir(cls, base_dir: str | pathlib.Path, *, dtype: torch.dtype = torch.float32,
                 device: str = "cpu") -> "MultiVariantModel":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=dtype).to(device)
        return cls(model, device=device)

    def check(self, variant: Variant) -> None:
        """ValueError when this base cannot apply one of the variant's tensors."""
        check_servable(variant, self.servable)

    def on_device(self, variant: Variant) -> Variant:
        if self.device.type == "cpu":
            return variant
        for pw in variant.packed.values():
            pw.signs, pw.scales = pw.signs.to(self.device), pw.scales.to(self.device)
        variant.dense = {k: t.to(self.device) for k, t in variant.dense.items()}
        return variant

    @torch.inference_mode()
    def forward(self, variants: list[Variant | None], **inputs):
        """The model's output for a batch whose row i uses ``variants[i]`` (None: the base alone)."""
        slots: list[Variant] = []
        index = []
        for v in variants:
            if v is None:
                index.append(-1)
                continue
            if not any(s is v for s in slots):
                slots.append(v)
            index.append(next(i for i, s in enumerate(slots) if s is v))
        self.ctx.variants = slots
        self.ctx.variant_of_row = torch.tensor(index, dtype=torch.long, device=self.device)
        try:
            return self.model(**inputs)
        finally:
            self.ctx.variants, self.ctx.variant_of_row = [], None

    def logits(self, variants: list[Variant | None], input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        """(B, T, vocab) logits of left- or right-padded rows."""
        pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        return self.forward(variants, input_ids=input_ids, attention_mask=attention_mask, position_ids=pos,
                            use_cache=False).logits

    def generate(self, variants: list[Variant | None], prompts: list[list[int]], *, max_new_tokens: list[int],
                 temperature: list[float], eos_ids: set[int], pad_id: int, top_p: list[float] | None = None,
                 generator: torch.Generator | None = None,
                 generators: list[torch.Generator | None] | None = None,
                 logprobs: list[int | None] | None = None) -> Iterator[tuple[list[int | None], list]]:
        """Decode all rows together (left padding, a KV cache object); yield each step's (token per row, None
        once a row stopped: EOS, which is yielded, or its own max_new_tokens; log-probs per row). Row i samples
        with ``generators[i]`` (else ``generator``; None: torch's global one), so its text does not depend on
        the other rows. Where ``logprobs[i]`` is k (not None), row i's log-probs are (the token's, the k most
        likely (id, log-prob) pairs) under log_softmax of the logits (before temperature and top_p)."""
        from transformers import DynamicCache

        b = len(prompts)
        gens = list(generators) if generators is not None else [generator] * b
        width = max(len(p) for p in prompts)
        ids = torch.full((b, width), pad_id, dtype=torch.long)
        mask = torch.zeros((b, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        temps = torch.tensor(temperature, dtype=torch.float32, device=self.device)
        top_ps = torch.tensor(top_p or [1.0] * b, dtype=torch.float32, device=self.device)
        done = [False] * b
        produced = [0] * b
        cache = DynamicCache(config=self.model.config)
        step_ids, step_pos = ids, pos
        for _ in range(max(max_new_tokens)):
            out = self.forward(variants, input_ids=step_ids, attention_mask=mask, position_ids=step_pos,
                               cache=cache, use_cache=True)
            last = out.logits[:, -1, :].float()
            nxt = _pick(last, temps, top_ps, gens)  # (B,)
            lps = _logprobs(last, nxt, logprobs or [None] * b)
            row = []
            for i in range(b):
                if done[i]:
                    row.append(None)
                    continue
                tok = int(nxt[i])
                produced[i] += 1
                row.append(tok)
                if tok in eos_ids or produced[i] >= max_new_tokens[i]:
                    done[i] = True
            yield row, lps
            if all(done):
                return
            step_ids = nxt.unsqueeze(1)
            step_pos = step_pos[:, -1:] + 1
            mask = torch.cat([mask, torch.ones((b, 1), dtype=mask.dtype, device=self.device)], dim=1)


def _logprobs(logits: Tensor, chosen: Tensor, ks: list[int | None]) -> list:
    """Per row: None, or (log-prob of chosen[i], [(id, log-prob)] of the ks[i] most likely tokens)."""
    rows = [i for i, k in enumerate(ks) if k is not None]
    out: list = [None] * len(ks)
    if not rows:
        return out
    lp = torch.log_softmax(logits[rows], dim=-1)
    mine = lp.gather(1, chosen[rows].unsqueeze(1)).squeeze(1).tolist()
    top_v, top_i = lp.topk(max(ks[i] for i in rows), dim=-1)
    top_v, top_i = top_v.tolist(), top_i.tolist()
    for j, i in enumerate(rows):
        out[i] = (mine[j], list(zip(top_i[j][:ks[i]], top_v[j][:ks[i]])))
    return out


def _pick(logits: Tensor, temps: Tensor, top_ps: Tensor, generators: list[torch.Generator | None]) -> Tensor:
    """Greedy for rows at temperature 0; otherwise sampled from softmax(logits / t) restricted to the
    smallest set of most likely tokens whose probability reaches top_p (nucleus sampling), each row
    with its own generator."""
    greedy = logits.argmax(-1)
    if not bool((temps > 0).any()):
        return greedy
    t = temps.clamp(min=1e-5).unsqueeze(1)
    probs = torch.softmax(logits / t, dim=-1)  # (B, V)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    outside = (sorted_p.cumsum(-1) - sorted_p) >= top_ps.unsqueeze(1)  # mass before a token already reaches p
    sorted_p = sorted_p.masked_fill(outside, 0.0)
    probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    probs = probs.cpu()
    sampled = greedy.clone().cpu()
    rows = torch.nonzero(temps > 0).flatten().tolist()
    shared = [i for i in rows if generators[i] is None]  # unseeded rows: one draw from torch's global generator
    if shared:
        sampled[shared] = torch.multinomial(probs[shared], 1).squeeze(1)
    for i in rows:
        if generators[i] is not None:
            sampled[i] = torch.multinomial(probs[i], 1, generator=generators[i])[0]
    return sampled.to(logits.device)
