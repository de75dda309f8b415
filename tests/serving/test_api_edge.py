"""gym-serve's HTTP edge, in process (Starlette's TestClient over a real Service and batcher on the tiny model).

Bad input never stops the server: seeds are bounded (64 bits unsigned), booleans strict, the body size is
limited before parsing, the prompt is checked against the context with or without max_tokens, an empty
prompt is refused as empty, a malformed or non-JSON body is read and answered in OpenAI's error shape, a
variant file that does not parse is skipped; a request that fails in the worker fails alone, and a dead
worker makes /health 503. --api-key guards every /v1 route; without it variant management is refused
from anyone but localhost. /metrics speaks Prometheus. A seeded fuzz of every route answers no 5xx.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import random
import time

import pytest
from starlette.testclient import TestClient

from zoo_gym.serving.app import create_app
from zoo_gym.serving.batcher import Job
from zoo_gym.serving.detok import Detok

HI = [{"role": "user", "content": "hi"}]
LOCAL = ("127.0.0.1", 5000)


def _client(service, *, client=LOCAL, **kw) -> TestClient:
    return TestClient(create_app(service, **kw), client=client, raise_server_exceptions=False)


@pytest.fixture(scope="module")
def http(inproc):
    return _client(inproc)


def _error(r, status: int, param=None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["type"] and err["message"] and "\n" not in err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def _ok_chat(http, **extra):
    r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": HI, "max_tokens": 2, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_huge_seed_is_refused_and_the_server_keeps_serving(http):
    for seed in (1180591620717411303424, 2**64, -1):
        _error(http.post("/v1/chat/completions", json={"model": "tiny", "messages": HI, "seed": seed,
                                                       "max_tokens": 2}), 400, "seed")
    _ok_chat(http, seed=2**64 - 1)
    _ok_chat(http)
    assert http.get("/health").status_code == 200


def test_prompt_longer_than_the_context_is_refused_with_or_without_max_tokens(http):
    long = [{"role": "user", "content": "hi " * 300}]
    for extra in ({}, {"max_tokens": 4}):
        err = _error(http.post("/v1/chat/completions", json={"model": "tiny", "messages": long, **extra}), 400)
        assert err["code"] == "context_length_exceeded"
    err = _error(http.post("/v1/completions", json={"model": "tiny", "prompt": "hi " * 300, "max_tokens": None}), 400)
    assert err["code"] == "context_length_exceeded"


def test_empty_prompt_is_refused_as_empty(http):
    err = _error(http.post("/v1/completions", json={"model": "tiny", "prompt": ""}), 400, "prompt")
    assert "empty" in err["message"] and "context" not in err["message"]


def test_booleans_are_strict(http):
    for bad in ({"stream": "yes"}, {"stream": 1}, {"stream": False, "stream_options": {"include_usage": "yes"}}):
        r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": HI, **bad})
        assert r.status_code == 400, (bad, r.text)


def test_body_size_is_limited_before_parsing(inproc):
    http = _client(inproc, max_body_bytes=10_000)
    big = json.dumps({"model": "tiny", "prompt": "x" * 20_000}).encode()
    t0 = time.monotonic()
    err = _error(http.post("/v1/completions", content=big, headers={"content-type": "application/json"}), 413)
    assert "10000" in err["message"]
    err = _error(http.post("/v1/completions", content=iter([big[:8000], big[8000:]])), 413)  # chunked
    assert time.monotonic() - t0 < 5
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": "The", "max_tokens": 1})
    assert r.status_code == 200, r.text


def test_body_without_content_type_is_read_as_json(http):
    body = json.dumps({"model": "tiny", "messages": HI, "max_tokens": 2}).encode()
    r = http.post("/v1/chat/completions", content=body, headers={"content-type": ""})
    assert r.status_code == 200, r.text
    r = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/x-www-form-urlencoded"})
    assert r.status_code == 200, r.text


def test_malformed_json_has_a_readable_message_and_no_param(http):
    body = json.dumps({"model": "tiny", "messages": HI})[:-5]
    err = _error(http.post("/v1/chat/completions", content=body.encode(),
                           headers={"content-type": "application/json"}), 400)
    assert err["param"] is None and "JSON" in err["message"]
    err = _error(http.post("/v1/chat/completions", json=[1, 2]), 400)
    assert err["param"] is None and "object" in err["message"]


@pytest.mark.parametrize("route, extra, param", [
    ("/v1/chat/completions", {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/chat/completions", {"frequency_penalty": 0.5}, "frequency_penalty"),
    ("/v1/chat/completions", {"presence_penalty": 1}, "presence_penalty"),
    ("/v1/chat/completions", {"logit_bias": {"1": 5}}, "logit_bias"),
    ("/v1/chat/completions", {"n": 2}, "n"),
    ("/v1/chat/completions", {"wizardry": 1}, "wizardry"),
    ("/v1/completions", {"best_of": 2}, "best_of"),
    ("/v1/completions", {"echo": True}, "echo"),
    ("/v1/completions", {"suffix": "x"}, "suffix"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/completions", {"logprobs": 6}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
])
def test_unsupported_options_are_refused_naming_them(http, route, extra, param):
    body = {"model": "tiny", "max_tokens": 2, **({"messages": HI} if "chat" in route else {"prompt": "The"}), **extra}
    err = _error(http.post(route, json=body), 400, param)
    assert err["type"] == "invalid_request_error" and param in err["message"]


def test_neutral_values_of_unsupported_options_are_accepted(http):
    _ok_chat(http, frequency_penalty=0, presence_penalty=0.0, n=1, tools=None, response_format={"type": "text"},
             user="alice", logprobs=False)


def test_retrieve_a_model(http):
    r = http.get("/v1/models/user1")
    assert r.status_code == 200 and r.json()["id"] == "user1" and r.json()["object"] == "model"
    assert http.get("/v1/models/tiny").json()["id"] == "tiny"
    assert _error(http.get("/v1/models/nobody"), 404)["code"] == "model_not_found"


def test_malformed_variant_file_is_skipped(inproc, http):
    bad = inproc.registry.directory / "broken.zgd"
    bad.write_bytes(b"this is not a variant" * 10)
    try:
        r = http.get("/v1/models")
        assert r.status_code == 200 and "broken" not in [m["id"] for m in r.json()["data"]]
        r = http.post("/v1/chat/completions", json={"model": "broken", "messages": HI})
        assert r.status_code in (400, 404), r.text
        assert http.post("/v1/variants", json={"name": "broken"}).status_code == 400
    finally:
        bad.unlink()


def test_a_failing_job_fails_alone(inproc):
    """A job the worker cannot run (an out-of-range seed slipped past the edge) fails; its batch-mates do not."""
    loop = asyncio.new_event_loop()
    try:
        ids = inproc.tokenizer("The")["input_ids"]
        bad = Job(prompt=ids, variant=None, max_tokens=2, temperature=1.0, loop=loop, seed=2**80)
        good = Job(prompt=ids, variant=None, max_tokens=2, temperature=1.0, loop=loop, seed=3)
        inproc.batcher.submit(bad)
        inproc.batcher.submit(good)

        async def drain(job):
            out = []
            while True:
                kind, value = await asyncio.wait_for(job.out.get(), 30)
                out.append(kind)
                if kind != "token":
                    return out

        assert loop.run_until_complete(drain(bad)) == ["error"]
        assert loop.run_until_complete(drain(good))[-1] == "done"
    finally:
        loop.close()
    assert inproc.batcher.alive


def test_dead_worker_makes_health_503(inproc, http):
    inproc.batcher.stop()
    try:
        assert http.get("/health").status_code == 503
        r = http.post("/v1/chat/completions", json={"model": "tiny", "messages": HI, "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error"
    finally:
        inproc.batcher.start()
    assert http.get("/health").status_code == 200
    _ok_chat(http)


def test_api_key_guards_inference_and_management(inproc):
    http = _client(inproc, api_key="s3cret", client=("10.1.2.3", 5000))
    for method, path, body in (("GET", "/v1/models", None), ("POST", "/v1/chat/completions",
                                                              {"model": "tiny", "messages": HI, "max_tokens": 1}),
                               ("DELETE", "/v1/variants/user1", None), ("POST", "/v1/variants", {"name": "user1"})):
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "s3cret"}):
            err = _error(http.request(method, path, json=body, headers=headers), 401)
            assert err["code"] == "invalid_api_key"
    good = {"Authorization": "Bearer s3cret"}
    assert http.get("/v1/models", headers=good).status_code == 200
    assert http.post("/v1/variants", json={"name": "user1"}, headers=good).status_code == 201
    assert http.get("/health").status_code == 200  # probes need no key


def test_refusals_are_counted_under_their_route(inproc):
    """A 401 (or 403, 413) answered before routing still counts under the route it was for; a path no route
    has counts under "other", so the labels stay bounded whatever the paths asked."""
    http = _client(inproc, api_key="s3cret", max_body_bytes=1000)
    http.post("/v1/chat/completions", json={"model": "tiny", "messages": HI})
    http.get("/v1/models/tiny", headers={"Authorization": "Bearer nope"})
    http.get("/v1/models", headers={"Authorization": "Bearer nope"})
    http.post("/v1/completions", content=b"x" * 2000, headers={"Authorization": "Bearer s3cret"})
    for i in range(3):
        http.get(f"/v1/no-such-route-{i}")
    http.get("/no-such-route")
    text = http.get("/metrics").text
    for want in ('gym_serve_requests_total{route="/v1/chat/completions",status="401"} 1.0',
                 'gym_serve_requests_total{route="/v1/models/{model_id:path}",status="401"} 1.0',
                 'gym_serve_requests_total{route="/v1/models",status="401"} 1.0',
                 'gym_serve_requests_total{route="/v1/completions",status="413"} 1.0',
                 'gym_serve_requests_total{route="other",status="401"} 3.0',
                 'gym_serve_requests_total{route="other",status="404"} 1.0'):
        assert want in text, want
    assert "no-such-route" not in text


def test_without_api_key_management_is_local_only(inproc):
    remote = _client(inproc, client=("10.1.2.3", 5000))
    for r in (remote.post("/v1/variants", json={"name": "user1"}), remote.delete("/v1/variants/user1")):
        err = _error(r, 403)
        assert "--api-key" in err["message"]
    assert remote.get("/v1/models").status_code == 200
    local = _client(inproc, client=("::1", 5000))
    assert local.post("/v1/variants", json={"name": "user1"}).status_code == 201


def test_metrics_in_prometheus_format(inproc):
    http = _client(inproc)
    used = _ok_chat(http)["usage"]
    with http.stream("POST", "/v1/completions", json={"model": "user1", "prompt": "The", "max_tokens": 3,
                                                      "stream": True}) as r:
        assert r.status_code == 200 and [line for line in r.iter_lines()]
    http.post("/v1/completions", json={"model": "tiny"})  # a 400
    r = http.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for want in ('gym_serve_requests_total{route="/v1/chat/completions",status="200"} 1.0',
                 'gym_serve_requests_total{route="/v1/completions",status="400"} 1.0',
                 "gym_serve_prompt_tokens_total ", "gym_serve_completion_tokens_total ",
                 "gym_serve_time_to_first_token_seconds_bucket", "gym_serve_time_per_output_token_seconds_count",
                 "gym_serve_variants_loaded ", "gym_serve_batch_occupancy_bucket"):
        assert want in text, want
    completion = [line for line in text.splitlines() if line.startswith("gym_serve_completion_tokens_total ")]
    prompt = [line for line in text.splitlines() if line.startswith("gym_serve_prompt_tokens_total ")]
    assert float(completion[0].split()[1]) >= used["completion_tokens"]
    assert float(prompt[0].split()[1]) >= used["prompt_tokens"] + 1


def _completion(http, seed, prompt="The"):
    r = http.post("/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 12,
                                           "temperature": 1.5, "seed": seed})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def test_a_seed_gives_the_same_text_whatever_else_is_in_the_batch(inproc, http):
    alone = _completion(http, 7)
    assert _completion(http, 7) == alone
    before = inproc.batcher.batches
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        futures = [pool.submit(_completion, http, s, p) for s, p in ((7, "The"), (8, "Once"), (None, "A"), (9, "The"))]
        texts = [f.result() for f in futures]
    assert texts[0] == alone
    assert inproc.batcher.batches - before < 4  # some of them shared a batch


def test_streaming_detokenisation_is_incremental_and_exact(inproc):
    tok = inproc.tokenizer
    text = "Grüße, 世界! 🦀 emoji and ascii; naïve café — done."
    ids = tok(text, add_special_tokens=False)["input_ids"]
    seen = []
    real = tok.decode

    def counting(ids_, **kw):
        seen.append(len(ids_))
        return real(ids_, **kw)

    tok.decode = counting
    try:
        d = Detok(tok, [])
        out = "".join(d.add(t) for t in ids * 8) + d.flush()
    finally:
        del tok.decode
    assert out == tok.decode(ids * 8, skip_special_tokens=True)
    assert sum(seen) < 12 * len(ids * 8)  # a bounded window per token, not every id again
    d = Detok(tok, ["ascii"])
    out = "".join(d.add(t) for t in ids) + d.flush()
    assert out == text[:text.index("ascii")] and d.stopped


def test_fuzz_every_route_answers_without_5xx(inproc):
    http = _client(inproc, max_body_bytes=20_000)
    rng = random.Random(20240530)
    routes = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
              ("GET", "/v1/models/user1"), ("POST", "/v1/variants"), ("DELETE", "/v1/variants/nobody"),
              ("GET", "/health"), ("GET", "/metrics"), ("POST", "/v1/models"), ("GET", "/v1/nope")]
    scalars = [None, True, False, 0, -1, 1, 2**63, 2**64, 10**30, -10**30, 1e308, -0.5, 0.5, 3.0, "", "x",
               "tiny", "user1", "\x00", "é" * 50, "../../etc/passwd", "hi " * 400, [], {}, [1], {"a": 1}]
    keys = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "seed",
            "stream", "stream_options", "stop", "n", "logprobs", "top_logprobs", "name", "path", "role", "content"]

    def value(depth=0):
        pick = rng.random()
        if depth < 2 and pick < 0.15:
            return [value(depth + 1) for _ in range(rng.randint(0, 3))]
        if depth < 2 and pick < 0.3:
            return {rng.choice(keys): value(depth + 1) for _ in range(rng.randint(0, 4))}
        return rng.choice(scalars)

    def body():
        kind = rng.random()
        if kind < 0.1:
            return bytes(rng.randrange(256) for _ in range(rng.randint(0, 200)))
        if kind < 0.15:
            return b"[" * 5000 + b"]" * 5000
        if kind < 0.2:
            return b"{" + b'"a":' * 3000
        obj = {"model": rng.choice(["tiny", "user1", "nobody", 5]), "max_tokens": rng.choice([1, 2, None, 0, -3])}
        obj["messages"] = [{"role": rng.choice(["user", "system", "assistant", "x", 1]), "content": value()}
                           for _ in range(rng.randint(0, 3))]
        obj["prompt"] = value()
        for k in rng.sample(keys, rng.randint(0, 6)):
            obj[k] = value()
        if rng.random() < 0.6 and isinstance(obj.get("max_tokens"), int) and obj["max_tokens"] > 2:
            obj["max_tokens"] = 2
        return json.dumps(obj).encode()

    for i in range(200):
        method, path = rng.choice(routes)
        headers = rng.choice([{}, {"content-type": "application/json"}, {"content-type": "text/plain"}])
        r = http.request(method, path, content=body() if method != "GET" else None, headers=headers)
        assert r.status_code < 500, (i, method, path, r.text)
    assert http.get("/health").status_code == 200
    _ok_chat(http)


def test_an_uncaught_exception_is_an_openai_500_without_a_traceback(inproc):
    """gym-serve has no known path to an uncaught exception (the fuzz above finds none), so a route that
    raises is added to the real app: Starlette answers it outside the Edge, through the app's handler."""
    app = create_app(inproc)

    def boom():
        raise RuntimeError("secret detail /srv/operator/path")
    app.add_api_route("/v1/boom", boom)
    http = TestClient(app, client=LOCAL, raise_server_exceptions=False)
    r = http.get("/v1/boom")
    err = _error(r, 500)
    assert err["type"] == "server_error" and err["param"] is None
    assert "Traceback" not in r.text and "secret" not in r.text and "/srv" not in r.text
    assert r.headers["content-type"] == "application/json"
    assert 'gym_serve_requests_total{route="/v1/boom",status="500"} 1.0' in http.get("/metrics").text
    _ok_chat(http)
