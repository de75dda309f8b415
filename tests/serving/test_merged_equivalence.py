"""gym-serve's model path equals the merged models (base + decoded delta), for mixed batches of variants.

For each base (the built-in tiny Qwen3; random-init Llama; GPT-2, with Conv1D weights stored (in, out) and
tied embeddings; Gemma, whose looked-up embeddings are scaled and whose norms use 1 + w) three variants
(groups of 128, and one of 64) change every tensor of the base (Linear/Conv1D weights, embeddings,
position embeddings, norms, biases) and are served together in one batch with a base-only row: every row's
logits agree with its own merged model, and greedy generations are identical token for token.
"""

from __future__ import annotations

import pytest
import torch

from serving_helpers import merged_model, random_variant_payload
from zoo_gym.gym_train import tiny_model_dir
from zoo_gym.gym_train.families import make_random_base
from zoo_gym.serving.model import MultiVariantModel
from zoo_gym.serving.variant import variant_from_payload, weights_sha256

N_NEW = 12


@pytest.fixture(scope="module", params=["tiny", "llama", "gpt2", "gemma"])
def base_dir(request, tmp_path_factory):
    if request.param == "tiny":
        return tiny_model_dir()
    return make_random_base(request.param, tmp_path_factory.mktemp(request.param), chat_template=False, seed=3)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (5, 9, 3, 7)]


def _greedy_alone(model, prompt: list[int], n: int) -> list[int]:
    """The obvious reference: the whole sequence through the merged model, argmax, append; no cache."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_mixed_batch_equals_merged_models(base_dir):
    sha = weights_sha256(base_dir)
    # the third has groups of 64: two group sizes in one batch
    payloads = [random_variant_payload(base_dir, seed=s, group_size=g) for s, g in ((1, 128), (2, 128), (3, 64))]
    variants = [variant_from_payload(p, name=f"v{i}", base_sha256=sha) for i, p in enumerate(payloads)]
    serving = MultiVariantModel.from_dir(base_dir)
    for v in variants:
        serving.check(v)
    merged = [merged_model(base_dir, p) for p in payloads] + [merged_model(base_dir, None)]
    rows = [variants[0], variants[1], None, variants[2]]  # row i served by rows[i]; merged[j] is its model
    which = [0, 1, 3, 2]
    prompts = _prompts(serving.model.config.vocab_size)

    # the variants do change the model (else equality below proves nothing)
    ids = torch.tensor([prompts[0]])
    with torch.no_grad():
        base_logits = merged[3](ids).logits
        v0_logits = merged[0](ids).logits
    assert (v0_logits - base_logits).abs().max() > 1e-2

    # logits of a left-padded mixed batch, row by row against the merged model alone
    width = max(map(len, prompts))
    batch = torch.zeros((4, width), dtype=torch.long)
    mask = torch.zeros_like(batch)
    for i, p in enumerate(prompts):
        batch[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    got = serving.logits(rows, batch, mask)
    for i, p in enumerate(prompts):
        with torch.no_grad():
            want = merged[which[i]](torch.tensor([p])).logits[0]
        torch.testing.assert_close(got[i, width - len(p):], want, rtol=1e-4, atol=1e-4)

    # greedy decoding of the same mixed batch
    steps = [row for row, _ in serving.generate(rows, prompts, max_new_tokens=[N_NEW] * 4, temperature=[0.0] * 4,
                                                eos_ids=set(), pad_id=0)]
    for i, p in enumerate(prompts):
        tokens = [s[i] for s in steps if s[i] is not None]
        assert tokens == _greedy_alone(merged[which[i]], p, N_NEW), f"row {i}"


def test_nucleus_of_one_token_is_greedy(base_dir):
    """top_p so small that only the most likely token is left: sampling at temperature 1 is greedy."""
    sha = weights_sha256(base_dir)
    v = variant_from_payload(random_variant_payload(base_dir, seed=5), name="v", base_sha256=sha)
    serving = MultiVariantModel.from_dir(base_dir)
    prompts = _prompts(serving.model.config.vocab_size)[:2]
    rows = [v, None]

    def run(**kw):
        return list(serving.generate(rows, prompts, max_new_tokens=[6, 6], eos_ids=set(), pad_id=0, **kw))

    greedy = run(temperature=[0.0, 0.0])
    assert run(temperature=[1.0, 1.0], top_p=[1e-6, 1e-6], generator=torch.Generator().manual_seed(0)) == greedy
