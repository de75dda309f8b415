"""Random variants of a base and the merged models they must equal, and a real gym-serve process started
and waited for (shared by the serving tests)."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
import time

import torch
from safetensors import safe_open

from zoo_gym import codec
from zoo_gym.serving.variant import encode_variant, weights_sha256


def base_tensors(base_dir: pathlib.Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(base_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            for k in sf.keys():
                out[k] = sf.get_tensor(k)
    return out


def random_variant_payload(base_dir: pathlib.Path, *, seed: int, scale: float = 0.02, only_2d: bool = False,
                           group_size: int = 128) -> bytes:
    """A variant changing every base tensor (2-D: bitdelta; 1-D: fp16) by a random delta."""
    g = torch.Generator().manual_seed(seed)
    delta = {}
    for name, t in base_tensors(base_dir).items():
        if only_2d and t.dim() != 2:
            continue
        delta[name] = torch.randn(t.shape, generator=g) * scale
    return encode_variant(delta, base_sha256=weights_sha256(base_dir), info={"seed": seed}, group_size=group_size)


def merged_model(base_dir: pathlib.Path, payload: bytes | None):
    """The base with the decoded delta added (what serving must reproduce)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32)
    model.eval()
    if payload is not None:
        params = dict(model.named_parameters())
        with torch.no_grad():
            for name, d in codec.decode(payload).items():
                params[name].add_(d.to(torch.float32))
    return model



def forced_logprobs(model, tokenizer, prompt: list[int], tokens: list[str], k: int) -> list[tuple[int, float, list, list]]:
    """Per answer token given as text: (its id, its log-prob, top-k ids, top-k log-probs) under log_softmax of
    `model`'s logits, one forward over prompt + answer. Each text must be the decoding of exactly one id."""
    by_text: dict[str, list[int]] = {}
    for i in range(len(tokenizer)):
        by_text.setdefault(tokenizer.decode([i]), []).append(i)
    ids = []
    for t in tokens:
        assert len(by_text.get(t, [])) == 1, (t, by_text.get(t))
        ids.append(by_text[t][0])
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt + ids])).logits[0].float(), -1)
    out = []
    for n, i in enumerate(ids):
        row = lp[len(prompt) - 1 + n]
        top = row.topk(k)
        out.append((i, float(row[i]), top.indices.tolist(), top.values.tolist()))
    return out


def start_gym_serve(*args: str, timeout: float = 120) -> tuple[subprocess.Popen, str, list[str]]:
    """`python -m zoo_gym.serving ARGS` with its stderr piped, once it said "listening on URL": the process,
    the URL and the stderr lines read so far (the rest stays in proc.stderr). Not started: killed, and fails."""
    proc = subprocess.Popen([sys.executable, "-m", "zoo_gym.serving", *args], stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url, lines = None, []
    deadline = time.monotonic() + timeout
    while url is None and time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"listening on (http://127\.0\.0\.1:\d+)", line)
        url = m.group(1) if m else None
    if url is None:
        proc.kill()
        proc.wait(timeout=20)
        raise AssertionError("gym-serve did not start:\n" + "".join(lines))
    return proc, url, lines
