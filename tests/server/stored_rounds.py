"""Shared by the server tests (and benchmarks/scale_out.py) that build a round's stored state without a server: a
tiny bf16 base, and submissions written as the servicer stores them (a payload blob and a Submission row)."""

from __future__ import annotations

from pathlib import Path

import torch
from sqlmodel import select

from zoo_gym.server.store.models import Contributor, Round, Submission


def tiny_bf16(out: Path) -> Path:
    """A tiny Qwen3 saved in bf16 (random weights, seed 0) with the built-in tokenizer: published weights are bf16
    with a stored low half."""
    from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

    from zoo_gym.gym_train import tiny_model_dir

    torch.manual_seed(0)
    cfg = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, vocab_size=320, tie_word_embeddings=True)
    Qwen3ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(tiny_model_dir())).save_pretrained(str(out))
    return out


def store_submissions(state, round_id: int, submissions: list[tuple[str, bytes, str]]) -> list[Submission]:
    """Each (contributor id, payload, codecs) stored as a blob and a Submission of round `round_id` against the
    round's base, its contributor registered when new; returns the round's submissions in id order."""
    with state.session() as s:
        base_sha = s.get(Round, round_id).base_sha256
        for cid, payload, codecs in submissions:
            with state.blobs.writer() as w:
                w.write(payload)
                sha = w.commit()
            if s.get(Contributor, cid) is None:
                s.add(Contributor(id=cid, public_key="00" * 32))
            s.add(Submission(round_id=round_id, contributor_id=cid, base_sha256=base_sha, payload_sha256=sha,
                             payload_size=len(payload), codecs=codecs))
        s.commit()
        return list(s.exec(select(Submission).where(Submission.round_id == round_id).order_by(Submission.id)))
