"""The OpenAI-compatible HTTP API of gym-serve (FastAPI).

``GET /v1/models`` and ``/v1/models/{id}``; ``POST /v1/chat/completions`` and ``/v1/completions`` (``stream:
true``: Server-Sent Events ending in ``data: [DONE]``; ``stream_options.include_usage``: a last chunk with the
usage; ``logprobs`` in OpenAI's shapes), ``model`` the base's id or a variant's name; ``POST /v1/variants``
and ``DELETE /v1/variants/{name}``; ``GET /health`` (503 when the decoding worker has stopped) and
``GET /metrics`` (Prometheus). Bodies are JSON whatever the content type, at most ``max_body_bytes``
(413, counted before parsing), validated by zoo_gym.serving.requests. With ``api_key`` every /v1 route
needs ``Authorization: Bearer KEY`` (401); without it, variant management is refused (403) from anyone
but localhost. Errors, an uncaught exception's 500 too, have OpenAI's shape (no traceback).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from zoo_gym.serving.batcher import Job
from zoo_gym.serving.detok import Detok
from zoo_gym.serving.edge import Edge, error_body
from zoo_gym.serving.logprobs import LogprobFormat
from zoo_gym.serving.metrics import Metrics
from zoo_gym.serving.registry import UnknownVariant, VariantTooLarge
from zoo_gym.serving.requests import AddVariant, ApiError, ChatRequest, CompletionRequest, parse, text_of
from zoo_gym.serving.service import Service
from zoo_gym.serving.streaming import sse, stream_chat, stream_completion
from zoo_gym.serving.variant import VariantError, VariantMismatch

WORKER_STOPPED = "the decoding worker has stopped; see the server's log"


def _variant_error(exc: Exception) -> ApiError:
    if isinstance(exc, UnknownVariant):
        name = exc.args[0] if exc.args else ""
        return ApiError(404, f"The model '{name}' does not exist", code="model_not_found", param="model")
    if isinstance(exc, VariantMismatch):
        return ApiError(400, str(exc), code="variant_base_mismatch")
    if isinstance(exc, VariantTooLarge):
        return ApiError(400, str(exc), code="variant_too_large")
    return ApiError(400, str(exc), code="invalid_variant")


def _model_entry(name: str, parent: str | None = None) -> dict:
    return {"id": name, "object": "model", "created": 0, "owned_by": "zoo-gym",
            **({"parent": parent} if parent else {})}


async def _resolve(service: Service, model: str) -> str | None:
    if model == service.base_name:
        return None
    try:
        await run_in_threadpool(service.registry.get, model)  # 404 / refusal now, before any streaming
    except (UnknownVariant, VariantError) as exc:
        raise _variant_error(exc) from None
    return model


def _make_job(service: Service, prompt_ids: list[int], req, max_tokens: int | None, variant: str | None,
              param: str) -> Job:
    limit, context, n = service.opts.max_tokens, service.context, len(prompt_ids)
    if not service.batcher.alive:
        raise ApiError(503, WORKER_STOPPED, type_="server_error")
    if n == 0:
        raise ApiError(400, "the prompt is empty", param=param)
    if n >= context:
        raise ApiError(400, f"the prompt ({n} tokens) leaves no room in the model's context of {context} tokens",
                       code="context_length_exceeded", param=param)
    want = max_tokens if max_tokens is not None else min(limit, context - n)
    if want > limit:
        raise ApiError(400, f"max_tokens {want} is more than this server allows ({limit})", param="max_tokens")
    if n + want > context:
        raise ApiError(400, f"the prompt ({n} tokens) plus max_tokens ({want}) exceeds the model's context of "
                            f"{context} tokens", code="context_length_exceeded", param="max_tokens")
    if req.stream_options is not None and not req.stream:
        raise ApiError(400, "stream_options is only allowed with stream: true", param="stream_options")
    return Job(prompt=prompt_ids, variant=variant, max_tokens=want, temperature=req.temperature,
               seed=req.seed, top_p=req.top_p, logprobs=req.logprob_k(), loop=asyncio.get_running_loop())


async def _next(service: Service, job: Job):
    while True:
        try:
            return await asyncio.wait_for(job.out.get(), 2.0)
        except asyncio.TimeoutError:
            if not service.batcher.alive:
                raise ApiError(503, WORKER_STOPPED, type_="server_error") from None


async def run_job(service: Service, metrics: Metrics, job: Job, detok: Detok) -> AsyncIterator[tuple]:
    """(text piece, None, log-prob entries) ... then ("", finish_reason, entries); each token's entry (when
    job.logprobs is set) comes with the first piece at or after it. ApiError when the worker refuses."""
    if not service.batcher.alive:
        raise ApiError(503, WORKER_STOPPED, type_="server_error")
    metrics.prompt_tokens.inc(len(job.prompt))
    start = last = time.monotonic()
    service.batcher.submit(job)
    entries: list = []
    while True:
        kind, value = await _next(service, job)
        if kind == "token":
            now = time.monotonic()
            (metrics.ttft if last == start else metrics.tpot).observe(now - last)
            last = now
            metrics.completion_tokens.inc()
            token, logprobs = value
            if logprobs is not None:
                entries.append((token, logprobs))
            piece = detok.add(token)
            if piece:
                yield piece, None, entries
                entries = []
            if detok.stopped:
                yield "", "stop", entries
                return
        elif kind == "done":
            tail = detok.flush()
            if tail:
                yield tail, None, entries
                entries = []
            yield "", value, entries
            return
        else:
            status, message = value
            raise ApiError(status, message, type_="server_error" if status >= 500 else "invalid_request_error",
                           code="model_not_found" if status == 404 else None)


def usage(job: Job, detok: Detok) -> dict:
    return {"prompt_tokens": len(job.prompt), "completion_tokens": len(detok.ids),
            "total_tokens": len(job.prompt) + len(detok.ids)}


def _stops(req) -> list[str]:
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError):
        return JSONResponse(error_body(exc.message, type_=exc.type, code=exc.code, param=exc.param),
                            status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(error_body(str(exc.detail), type_=type_), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception):
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}", type_="server_error"),
                            status_code=500)


def _add_model_routes(app: FastAPI, service: Service, metrics: Metrics) -> None:
    @app.get("/v1/models")
    async def list_models():
        names = await run_in_threadpool(service.registry.names)
        return {"object": "list", "data": [_model_entry(service.base_name)]
                + [_model_entry(n, service.base_name) for n in names]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        if model_id == service.base_name:
            return _model_entry(model_id)
        if model_id not in await run_in_threadpool(service.registry.names):
            raise _variant_error(UnknownVariant(model_id))
        return _model_entry(model_id, service.base_name)

    @app.get("/health")
    async def health():
        alive = service.batcher.alive
        body = {"status": "ok" if alive else "worker stopped", "base_sha256": service.base_sha256,
                "loaded": service.registry.loaded(), "resident_variant_bytes": service.registry.resident_bytes(),
                "batches": service.batcher.batches, "largest_batch": service.batcher.largest_batch}
        return JSONResponse(body, status_code=200 if alive else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.post("/v1/variants", status_code=201)
    async def add_variant(request: Request):
        body = parse(AddVariant, await request.body())
        if not body.name and not body.path:
            raise ApiError(400, "give `name` (a NAME.zgd in the variants directory) or `path` (a .zgd file)",
                           param="name")
        if body.name == service.base_name:
            raise ApiError(400, f"{body.name!r} is the base's id", param="name")
        try:
            v = await run_in_threadpool(service.registry.add, name=body.name, path=body.path)
        except (UnknownVariant, VariantError) as exc:
            raise _variant_error(exc) from None
        return JSONResponse({**_model_entry(v.name, service.base_name), "bytes": v.nbytes}, status_code=201)

    @app.delete("/v1/variants/{name}")
    async def delete_variant(name: str):
        try:
            await run_in_threadpool(service.registry.remove, name)
        except UnknownVariant as exc:
            raise _variant_error(exc) from None
        return {"id": name, "object": "model", "deleted": True}


def _chat_ids(service: Service, req: ChatRequest) -> list[int]:
    tok = service.tokenizer
    if not getattr(tok, "chat_template", None):
        raise ApiError(400, f"the base {service.base_name!r} has no chat template; use /v1/completions",
                       param="messages")
    messages = [{"role": m.role, "content": text_of(m.content)} for m in req.messages]
    try:
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    except Exception as exc:  # noqa: BLE001 - a template may refuse a message order
        raise ApiError(400, f"the chat template refused these messages: {exc}", param="messages") from None
    return tok(text, add_special_tokens=False)["input_ids"]


def _completion_ids(service: Service, req: CompletionRequest) -> list[int]:
    prompt = req.prompt
    if isinstance(prompt, list):
        if len(prompt) != 1:
            raise ApiError(400, "give one prompt per request", param="prompt")
        prompt = prompt[0]
    return service.tokenizer(prompt)["input_ids"] if prompt else []


async def _collect(pieces) -> tuple[str, str | None, list]:
    parts, finish, entries = [], None, []
    async for piece, finish, more in pieces:
        parts.append(piece)
        entries += more
    return "".join(parts), finish, entries


def _add_completion_routes(app: FastAPI, service: Service, metrics: Metrics) -> None:
    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = parse(ChatRequest, await request.body())
        variant = await _resolve(service, req.model)
        ids = await run_in_threadpool(_chat_ids, service, req)
        job = _make_job(service, ids, req, req.max_completion_tokens or req.max_tokens, variant, "messages")
        detok = Detok(service.tokenizer, _stops(req))
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": req.model}
        pieces = run_job(service, metrics, job, detok)
        fmt = LogprobFormat(service.tokenizer).chat if job.logprobs is not None else None
        if req.stream:
            return sse(stream_chat(head, pieces, lambda: usage(job, detok), req.stream_options, fmt))
        text, finish, entries = await _collect(pieces)
        return {**head, "object": "chat.completion", "usage": usage(job, detok),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "logprobs": fmt(entries) if fmt else None, "finish_reason": finish}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = parse(CompletionRequest, await request.body())
        variant = await _resolve(service, req.model)
        ids = await run_in_threadpool(_completion_ids, service, req)
        job = _make_job(service, ids, req, req.max_tokens, variant, "prompt")
        detok = Detok(service.tokenizer, _stops(req))
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": req.model}
        pieces = run_job(service, metrics, job, detok)
        fmt = LogprobFormat(service.tokenizer).completion if job.logprobs is not None else None
        if req.stream:
            return sse(stream_completion(head, pieces, lambda: usage(job, detok), req.stream_options, fmt))
        text, finish, entries = await _collect(pieces)
        return {**head, "usage": usage(job, detok),
                "choices": [{"index": 0, "text": text, "logprobs": fmt(entries) if fmt else None,
                             "finish_reason": finish}]}


def create_app(service: Service, *, api_key: str | None = None, max_body_bytes: int = 1_000_000) -> FastAPI:
    metrics = Metrics(loaded_variants=service.registry.loaded, max_batch=service.batcher.max_batch)
    service.batcher.on_batch = metrics.batch.observe
    app = FastAPI(title="gym-serve", docs_url=None, redoc_url=None, openapi_url=None)
    _add_error_handlers(app)
    _add_model_routes(app, service, metrics)
    _add_completion_routes(app, service, metrics)
    app.add_middleware(Edge, api_key=api_key, max_body_bytes=max_body_bytes, metrics=metrics, routes=app.routes)
    return app
