"""The real `gym-serve` process over HTTP on 127.0.0.1 (an ephemeral port).

Checks the OpenAI surface a client relies on: /v1/models lists the base and the variants of this base
(a variant built for another base is not listed, and adding it is refused with one line); a chat
completion of a variant at temperature 0 is the merged model's greedy text under the base's own chat
template; streaming sends chat.completion.chunk events whose text equals the non-streamed answer and
ends in [DONE]; requests for different variants sent together are decoded in one batch and each still
gets its own answer; an unknown model is 404 and a bad request 400, both in OpenAI's error shape;
variants are removed and added at run time, and with --max-variant-bytes the least recently used one is
unloaded.
"""

from __future__ import annotations

import concurrent.futures
import json
import shutil
import subprocess

import httpx
import pytest
import torch

from serving_helpers import forced_logprobs, merged_model, random_variant_payload, start_gym_serve
from zoo_gym.gym_train import tiny_model_dir
from zoo_gym.gym_train.families import make_random_base
from zoo_gym.serving.variant import write_variant

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "What is 2+2?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve")
    base = root / "base"
    shutil.copytree(tiny_model_dir(), base)
    vdir = root / "variants"
    payloads = {f"user{s}": random_variant_payload(base, seed=s, scale=0.004) for s in (1, 2, 3)}
    for name, p in payloads.items():
        write_variant(vdir / f"{name}.zgd", p)
    other = make_random_base("llama", root / "other", seed=1)
    write_variant(vdir / "stranger.zgd", random_variant_payload(other, seed=9))
    (vdir / "broken.zgd").write_bytes(b"not a variant at all" * 50)  # skipped with a log line, not a crash
    one_variant = len(payloads["user1"])  # the packed in-memory size is close to the file's
    proc, url, lines = start_gym_serve("--base", str(base), "--variants", str(vdir), "--port", "0",
                                       "--batch-window-ms", "300", "--max-variant-bytes", str(int(one_variant * 2.5)))
    client = httpx.Client(base_url=url, timeout=120)
    try:
        yield {"client": client, "base": base, "payloads": payloads, "lines": lines, "vdir": vdir, "proc": proc}
    finally:
        client.close()
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)


def test_malformed_variant_file_is_logged_and_not_listed(served):
    assert any("broken.zgd" in line and "not serving" in line for line in served["lines"])
    assert served["client"].get("/v1/models").status_code == 200


def test_json_logs_and_api_key(tmp_path):
    """--log-format json: every line on stderr is one JSON object (uvicorn's too); --api-key guards /v1."""
    vdir = tmp_path / "variants"
    vdir.mkdir()
    (vdir / "broken.zgd").write_bytes(b"\x00" * 300)
    proc, url, lines = start_gym_serve("--base", "tiny", "--variants", str(vdir), "--port", "0", "--log-format",
                                       "json", "--api-key", "k3y", "--max-tokens", "4")
    try:
        with httpx.Client(base_url=url, timeout=60) as client:
            assert client.get("/v1/models").status_code == 401
            r = client.post("/v1/completions", headers={"Authorization": "Bearer k3y"},
                            json={"model": "tiny", "prompt": "The", "max_tokens": 2})
            assert r.status_code == 200, r.text
            assert client.get("/nope").status_code == 404
    finally:
        proc.terminate()
        _, rest = proc.communicate(timeout=30)
    lines += rest.splitlines(keepends=True)
    records = [json.loads(line) for line in lines if line.strip()]  # every line parses
    assert all({"time", "level", "logger", "message"} <= r.keys() and "color_message" not in r for r in records)
    assert any("broken.zgd" in r["message"] for r in records)
    access = [r for r in records if r["logger"] == "uvicorn.access"]
    assert {a.get("status") for a in access} >= {200, 401, 404}, access
    assert "\x1b[" not in "".join(lines)


def _greedy_chat(base, payload, n: int) -> str:
    """The merged model's greedy reply under the base's chat template (no cache, whole sequence each step)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(base))
    model = merged_model(base, payload)
    text = tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    out = []
    with torch.no_grad():
        for _ in range(n):
            t = int(model(torch.tensor([ids + out])).logits[0, -1].argmax())
            if t == tok.eos_token_id:
                break
            out.append(t)
    return tok.decode(out, skip_special_tokens=True)


def _chat(client, model: str, **extra) -> httpx.Response:
    return client.post("/v1/chat/completions", json={"model": model, "messages": QUESTION, "max_tokens": 24,
                                                     "temperature": 0, **extra})


def test_models_lists_base_and_own_variants(served):
    r = served["client"].get("/v1/models")
    assert r.status_code == 200
    ids = [m["id"] for m in r.json()["data"]]
    assert ids == ["base", "user1", "user2", "user3"]  # not "stranger": built for another base
    assert all(m["object"] == "model" for m in r.json()["data"])


def test_chat_of_a_variant_is_the_merged_models_greedy_reply(served):
    r = _chat(served["client"], "user2")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == "user2"
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    want = _greedy_chat(served["base"], served["payloads"]["user2"], 24)
    assert body["choices"][0]["message"]["content"] == want


def test_streaming_sends_chunks_ending_in_done(served):
    plain = _chat(served["client"], "user1").json()["choices"][0]["message"]["content"]
    events = []
    with served["client"].stream("POST", "/v1/chat/completions",
                                 json={"model": "user1", "messages": QUESTION, "max_tokens": 24, "temperature": 0,
                                       "stream": True}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: "):])
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" and c["model"] == "user1" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == plain

    text = []
    with served["client"].stream("POST", "/v1/completions", json={"model": "base", "prompt": "The", "max_tokens": 5,
                                                                  "temperature": 0, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                c = json.loads(line[6:])
                assert c["object"] == "text_completion"
                text.append(c["choices"][0]["text"])
    plain = served["client"].post("/v1/completions", json={"model": "base", "prompt": "The", "max_tokens": 5,
                                                          "temperature": 0}).json()
    assert "".join(text) == plain["choices"][0]["text"]


def test_logprobs_of_a_variant_in_a_mixed_batch_through_the_openai_client(served):
    """The real process, the official client: a variant's logprobs (a seeded sampled answer), asked beside a
    base request that asks none, are log_softmax of the merged model's logits (the top 2 too)."""
    import openai
    from transformers import AutoTokenizer

    client = openai.OpenAI(base_url=f"{served['client'].base_url}/v1", api_key="unused", max_retries=0)
    ask = dict(model="user3", messages=QUESTION, max_tokens=10, temperature=2.0, seed=26, logprobs=True,
               top_logprobs=2)
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        other = pool.submit(_chat, served["client"], "base")
        r = pool.submit(client.chat.completions.create, **ask).result()
        assert other.result().json()["choices"][0]["logprobs"] is None
    content = r.choices[0].logprobs.content
    assert len(content) >= 3
    tok = AutoTokenizer.from_pretrained(str(served["base"]))
    prompt = tok(tok.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False),
                 add_special_tokens=False)["input_ids"]
    merged = merged_model(served["base"], served["payloads"]["user3"])
    ref = forced_logprobs(merged, tok, prompt, [e.token for e in content], 2)
    assert [e.logprob for e in content] == pytest.approx([lp for _, lp, *_ in ref], abs=1e-3)
    for e, (*_, top_ids, top_lps) in zip(content, ref):
        assert [t.token for t in e.top_logprobs] == [tok.decode([i]) for i in top_ids]
        assert [t.logprob for t in e.top_logprobs] == pytest.approx(top_lps, abs=1e-3)
    streamed = [e for c in client.chat.completions.create(**ask, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]


def test_different_variants_share_one_batch(served):
    client = served["client"]
    alone = {m: _chat(client, m).json()["choices"][0]["message"]["content"] for m in ("user1", "user3", "base")}
    before = client.get("/health").json()["largest_batch"]
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        futures = {m: pool.submit(_chat, client, m) for m in alone}
        together = {m: f.result().json()["choices"][0]["message"]["content"] for m, f in futures.items()}
    assert together == alone
    assert client.get("/health").json()["largest_batch"] >= max(before, 2)


def test_errors_have_openai_shape(served):
    client = served["client"]
    r = _chat(client, "nobody")
    assert r.status_code == 404
    err = r.json()["error"]
    assert err["code"] == "model_not_found" and "nobody" in err["message"]
    for bad in ({"model": "base"},  # no messages
                {"model": "base", "messages": QUESTION, "temperature": 7},
                {"model": "base", "messages": [{"role": "wizard", "content": "hi"}]},
                {"model": "base", "messages": QUESTION, "max_tokens": 10**6}):
        r = client.post("/v1/chat/completions", json=bad)
        assert r.status_code == 400, (bad, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and err["message"]
    r = client.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()
    r = client.post("/v1/variants", json={"path": "/etc/passwd"})  # only NAME.zgd files are read
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_variant"
    assert client.post("/v1/variants", json={}).status_code == 400


def test_variant_for_another_base_is_refused(served):
    client = served["client"]
    r = client.post("/v1/variants", json={"name": "stranger"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["code"] == "variant_base_mismatch" and "\n" not in err["message"]
    assert "another base" in err["message"] or "built for base" in err["message"]
    assert _chat(client, "stranger").status_code == 400
    assert any("stranger.zgd" in line and "built for base" in line for line in served["lines"])


def test_variants_removed_added_and_evicted(served):
    client = served["client"]
    r = client.delete("/v1/variants/user3")
    assert r.status_code == 200 and r.json()["deleted"] is True
    assert "user3" not in [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert _chat(client, "user3").status_code == 404
    assert client.delete("/v1/variants/user3").status_code == 404
    r = client.post("/v1/variants", json={"name": "user3"})
    assert r.status_code == 201 and r.json()["id"] == "user3"
    assert _chat(client, "user3").status_code == 200
    # a budget of 2.5 variants: using a third unloads the least recently used one
    for m in ("user1", "user2", "user3"):
        assert _chat(client, m, max_tokens=1).status_code == 200
    health = client.get("/health").json()
    assert health["loaded"] == ["user2", "user3"]
    assert health["resident_variant_bytes"] <= int(len(served["payloads"]["user1"]) * 2.5)
    # a file dropped into the directory is served without a restart
    write_variant(served["vdir"] / "late.zgd", served["payloads"]["user1"])
    assert "late" in [m["id"] for m in client.get("/v1/models").json()["data"]]
    assert _chat(client, "late").json()["choices"][0]["message"]["content"] == \
        _chat(client, "user1").json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("args, message", [
    (["--base", "tiny", "--variants", "/no/such/dir"], "--variants"),
    (["--base", "no/such-model-here"], "neither a built-in base"),
    (["--base", "tiny", "--dtype", "int3"], "--dtype"),
])
def test_bad_serve_options_exit_2_with_one_line(args, message):
    from typer.testing import CliRunner

    from zoo_gym.serving.cli import app

    r = CliRunner().invoke(app, args)
    assert r.exit_code == 2, r.output
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], r.stderr
