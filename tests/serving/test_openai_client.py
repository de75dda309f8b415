"""OpenAI conformance through the official `openai` client (in process, over Starlette's TestClient).

Retrieving a model; `stream_options.include_usage` puts the usage on a last chunk with no choices; a seeded
request gives the same text alone and batched with others; `logprobs` (chat: with `top_logprobs`) of a
sampled answer are log_softmax of the merged model's logits for its tokens, streamed or not; unsupported options are
refused as BadRequestError naming the parameter; a malformed body has a readable message and no param.
"""

from __future__ import annotations

import concurrent.futures

import openai
import pytest
import torch
from serving_helpers import forced_logprobs, merged_model
from starlette.testclient import TestClient

from zoo_gym.serving.app import create_app

HI = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def client(inproc):
    http = TestClient(create_app(inproc, api_key="k"), client=("127.0.0.1", 5000))
    return openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=http, max_retries=0)


def test_models_list_and_retrieve(client):
    ids = [m.id for m in client.models.list()]
    assert ids[:3] == ["tiny", "user1", "user2"]
    m = client.models.retrieve("user2")
    assert m.id == "user2" and m.object == "model"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nobody")


def test_wrong_key_is_authentication_error(inproc):
    http = TestClient(create_app(inproc, api_key="k"), client=("127.0.0.1", 5000))
    bad = openai.OpenAI(base_url="http://testserver/v1", api_key="wrong", http_client=http, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_chat_and_stream_with_usage(client):
    plain = client.chat.completions.create(model="user1", messages=HI, max_tokens=8, temperature=0)
    assert plain.usage.completion_tokens >= 1 and plain.choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="user1", messages=HI, max_tokens=8, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.model_dump() == plain.usage.model_dump()
    assert all(c.usage is None for c in chunks[:-1])
    assert "".join(c.choices[0].delta.content or "" for c in chunks[:-1]) == plain.choices[0].message.content
    text = list(client.completions.create(model="tiny", prompt="The", max_tokens=4, stream=True, temperature=0,
                                          stream_options={"include_usage": True}))
    assert 1 <= text[-1].usage.completion_tokens <= 4 and text[-1].choices == []


def _seeded(client, seed, prompt):
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=12, temperature=1.5, seed=seed)
    return r.choices[0].text


def test_seed_is_per_request(client):
    alone = _seeded(client, 7, "The")
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(_seeded, client, s, p) for s, p in ((8, "Once"), (7, "The"), (None, "A"))]
        assert futures[1].result() == alone
        [f.result() for f in futures]


def _check(entries, ref, k: int) -> None:
    for got, (_, want, top_ids, top_lps) in zip(entries, ref, strict=True):
        assert got.logprob == pytest.approx(want, abs=1e-3)
        assert len(got.top_logprobs) == k and bytes(got.bytes) == got.token.encode()
        assert [t.logprob for t in got.top_logprobs] == pytest.approx(top_lps, abs=1e-3)


def test_chat_logprobs_are_the_merged_models(client, inproc):
    """A sampled answer (temperature 2, a seed whose answer is 3 tokens: the greedy one is one digit): each token's
    logprob and top 3 are log_softmax of the merged model's logits, before temperature."""
    tok = inproc.tokenizer
    ask = dict(model="user1", messages=HI, max_tokens=12, temperature=2.0, seed=26, logprobs=True, top_logprobs=3)
    r = client.chat.completions.create(**ask)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens >= 3
    special = {str(t) for t in tok.added_tokens_decoder.values() if t.special}  # the answer's text skips them
    assert "".join(e.token for e in content if e.token not in special) == r.choices[0].message.content
    prompt = tok(tok.apply_chat_template(HI, add_generation_prompt=True, tokenize=False),
                 add_special_tokens=False)["input_ids"]
    merged = merged_model(inproc.base_dir, (inproc.registry.directory / "user1.zgd").read_bytes())
    ref = forced_logprobs(merged, tok, prompt, [e.token for e in content], 3)
    _check(content, ref, 3)
    assert [[t.token for t in e.top_logprobs] for e in content] == [[tok.decode([i]) for i in ids]
                                                                   for _, _, ids, _ in ref]
    chunks = list(client.chat.completions.create(**ask, stream=True))
    streamed = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]  # same seed, same tokens
    assert [e.logprob for e in streamed] == pytest.approx([e.logprob for e in content], abs=1e-4)
    plain = client.chat.completions.create(model="user1", messages=HI, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_in_the_legacy_shape(client, inproc):
    tok = inproc.tokenizer
    ask = dict(model="tiny", prompt="The", max_tokens=10, temperature=2.0, seed=26, logprobs=2)
    r = client.completions.create(**ask)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == r.usage.completion_tokens >= 3
    special = {str(t) for t in tok.added_tokens_decoder.values() if t.special}
    assert "".join(t for t in lp.tokens if t not in special) == r.choices[0].text
    ref = forced_logprobs(merged_model(inproc.base_dir, None), tok, tok("The")["input_ids"], lp.tokens, 2)
    assert lp.token_logprobs == pytest.approx([w for _, w, *_ in ref], abs=1e-3)
    for top, token, (_, _, top_ids, top_lps) in zip(lp.top_logprobs, lp.tokens, ref):
        assert token in top and len(top) <= 3  # the sampled token is always listed (OpenAI's logprobs + 1)
        for i, v in zip(top_ids, top_lps):
            assert top[tok.decode([i])] == pytest.approx(v, abs=1e-3)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:n]) for n in range(len(lp.tokens))]
    streamed = [c.choices[0].logprobs for c in client.completions.create(**ask, stream=True) if c.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset


@pytest.mark.parametrize("kw, param", [
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"logprobs": 1}, "logprobs"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"response_format": {"type": "json_object"}}, "response_format"),
    ({"frequency_penalty": 1.0}, "frequency_penalty"),
    ({"n": 2}, "n"),
    ({"seed": 2**70}, "seed"),
    ({"extra_body": {"stream": "yes"}}, "stream"),
])
def test_unsupported_or_bad_options_are_bad_requests(client, kw, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=HI, max_tokens=2, **kw)
    assert info.value.body["param"] == param and info.value.body["type"] == "invalid_request_error"


def test_malformed_body(inproc):
    http = TestClient(create_app(inproc), client=("127.0.0.1", 5000))
    r = http.post("/v1/completions", content=b'{"model": "tiny", "prompt": "a', headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["param"] is None and "not valid JSON" in err["message"]
