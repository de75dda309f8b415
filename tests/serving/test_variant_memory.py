"""A loaded variant keeps the codec's log8 scale codes (1 byte per group + one reference per tensor), not
float32 scales: at most 1/15 of the bf16 bytes of the weights it changes (issue 17's target), counted
from the tensors the Variant really holds, and it still serves exactly the merged model.

The base is a random-init Llama whose rows are multiples of 128 wide (hidden 256, intermediate 512), so
every row is whole groups of 128: 1 bit per weight + 8 bits per 128 weights = 1/15.06 of bf16.
"""

from __future__ import annotations

import pytest
import torch

from serving_helpers import merged_model, random_variant_payload
from zoo_gym.serving.model import MultiVariantModel
from zoo_gym.serving.variant import Variant, variant_from_payload, weights_sha256

N_NEW = 8


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from zoo_gym.gym_train import tiny_model_dir

    out = tmp_path_factory.mktemp("llama256")
    tok = AutoTokenizer.from_pretrained(str(tiny_model_dir()))
    tok.chat_template = None
    cfg = AutoConfig.for_model("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                               tie_word_embeddings=True, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                               pad_token_id=tok.pad_token_id, bos_token_id=None)
    torch.manual_seed(7)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(out, max_shard_size="1000GB")
    tok.save_pretrained(out)
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


def _held_bytes(v: Variant) -> int:
    """Bytes of every tensor the variant keeps (plus 4 per float32 log8 reference)."""
    n = 0
    for pw in v.packed.values():
        n += pw.signs.numel() * pw.signs.element_size() + pw.scales.numel() * pw.scales.element_size()
        n += 4 if pw.scale_ref is not None else 0
    return n + sum(t.numel() * t.element_size() for t in v.dense.values())


def test_variant_holds_log8_codes_within_one_fifteenth_of_bf16(llama_dir):
    sha = weights_sha256(llama_dir)
    payload = random_variant_payload(llama_dir, seed=11, only_2d=True)
    v = variant_from_payload(payload, name="lean", base_sha256=sha)
    assert v.packed and not v.dense
    assert all(pw.scales.dtype == torch.uint8 for pw in v.packed.values())
    bf16 = sum(pw.shape[0] * pw.shape[1] * 2 for pw in v.packed.values())
    held = _held_bytes(v)
    assert held * 15 <= bf16, f"variant holds {held} bytes: 1/{bf16 / held:.2f} of {bf16} bf16 bytes"
    assert v.nbytes == held  # what the LRU budget and /health count is what is resident

    # still the merged model, token for token and in logits
    serving = MultiVariantModel.from_dir(llama_dir)
    serving.check(v)
    merged = merged_model(llama_dir, payload)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, serving.model.config.vocab_size, (n,), generator=g).tolist() for n in (6, 4)]
    got = serving.logits([v], torch.tensor([prompts[0]]), torch.ones(1, len(prompts[0]), dtype=torch.long))
    with torch.no_grad():
        want = merged(torch.tensor([prompts[0]])).logits
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    steps = [row for row, _ in serving.generate([v, None], prompts, max_new_tokens=[N_NEW] * 2, temperature=[0.0] * 2,
                                                eos_ids=set(), pad_id=0)]
    tokens = [s[0] for s in steps if s[0] is not None]
    ids = list(prompts[0])
    with torch.no_grad():
        for _ in range(N_NEW):
            ids.append(int(merged(torch.tensor([ids])).logits[0, -1].argmax()))
    assert tokens == ids[len(prompts[0]):]


def test_float32_scale_payloads_stay_float32(llama_dir):
    """A payload whose scales are not log8 (e.g. float32) is kept as float32 scales, counted so, and served
    in one batch with a log8 variant (two kernel calls per Linear), each row equal to its merged model."""
    from serving_helpers import base_tensors
    from zoo_gym import codec

    sha = weights_sha256(llama_dir)
    g = torch.Generator().manual_seed(2)
    delta = {k: torch.randn(t.shape, generator=g) * 0.02 for k, t in base_tensors(llama_dir).items() if t.dim() == 2}
    payload = codec.encode(delta, codec="bitdelta", group_size=128, scale_dtype="float32",
                           metadata={"zoo_gym_variant": 1, "base_sha256": sha})
    v = variant_from_payload(payload, name="f32", base_sha256=sha)
    assert all(pw.scales.dtype == torch.float32 and pw.scale_ref is None for pw in v.packed.values())
    assert v.nbytes == _held_bytes(v)

    log8_payload = random_variant_payload(llama_dir, seed=12)  # every tensor, norms too
    w = variant_from_payload(log8_payload, name="log8", base_sha256=sha)
    serving = MultiVariantModel.from_dir(llama_dir)
    prompt = torch.randint(3, serving.model.config.vocab_size, (5,), generator=g)
    got = serving.logits([v, w], prompt.expand(2, -1), torch.ones(2, 5, dtype=torch.long))
    for i, p in enumerate((payload, log8_payload)):
        with torch.no_grad():
            want = merged_model(llama_dir, p)(prompt[None]).logits[0]
        torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-4)
