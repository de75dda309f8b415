"""The OpenAI-compatible HTTP API of gym-serve (FastAPI).

``GET /v1/models``; ``POST /v1/chat/completions`` and ``/v1/completions`` (``stream: true`` answers
Server-Sent Events of ``chat.completion.chunk`` / ``text_completion`` objects ending in ``data: [DONE]``),
where ``model`` is the base's id or a variant's name; ``POST /v1/variants`` and
``DELETE /v1/variants/{name}``. Errors have OpenAI's shape ``{"error": {"message", "type", "param",
"code"}}``: 400 for a bad request, 404 for an unknown model.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from zoo_gym.serving.batcher import Job
from zoo_gym.serving.registry import UnknownVariant, VariantTooLarge
from zoo_gym.serving.service import Service
from zoo_gym.serving.variant import VariantError, VariantMismatch


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type_


def _error_body(message: str, *, type_: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(1, ge=1, le=1)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class CompletionRequest(_Request):
    prompt: str | list[str]
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for /v1/completions


class AddVariant(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str | None = None
    path: str | None = None


def _text(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part.get("text", "") for part in content if part.get("type") == "text")


def _variant_error(exc: Exception) -> ApiError:
    if isinstance(exc, UnknownVariant):
        name = exc.args[0] if exc.args else ""
        return ApiError(404, f"The model '{name}' does not exist", code="model_not_found", param="model")
    if isinstance(exc, VariantMismatch):
        return ApiError(400, str(exc), code="variant_base_mismatch")
    if isinstance(exc, VariantTooLarge):
        return ApiError(400, str(exc), code="variant_too_large")
    return ApiError(400, str(exc), code="invalid_variant")


class _Detok:
    """Incremental detokenization: the text each new token adds (held back while a character is split)."""

    def __init__(self, tokenizer, stop: list[str]) -> None:
        self.tok, self.stop = tokenizer, [s for s in stop if s]
        self.ids: list[int] = []
        self.sent = 0
        self.stopped = False

    def add(self, token: int) -> str:
        if self.stopped:
            return ""
        self.ids.append(token)
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            at = text.find(s)
            if at >= 0:
                self.stopped = True
                out, self.sent = text[self.sent:at], at
                return out
        if text.endswith("\ufffd"):
            return ""
        hold = max((len(s) - 1 for s in self.stop), default=0)
        end = max(self.sent, len(text) - hold)
        out, self.sent = text[self.sent:end], end
        return out

    def flush(self) -> str:
        if self.stopped:
            return ""
        text = self.tok.decode(self.ids, skip_special_tokens=True)
        out, self.sent = text[self.sent:], len(text)
        return out


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


def _make_job(service: Service, prompt_ids: list[int], req: _Request, max_tokens: int | None,
              variant: str | None) -> Job:
    limit = service.opts.max_tokens
    want = max_tokens if max_tokens is not None else min(limit, service.context - len(prompt_ids))
    if want > limit:
        raise ApiError(400, f"max_tokens {want} is more than this server allows ({limit})", param="max_tokens")
    if len(prompt_ids) + want > service.context or not prompt_ids:
        raise ApiError(400, f"the prompt ({len(prompt_ids)} tokens) plus max_tokens ({want}) exceeds the "
                            f"model's context of {service.context} tokens", code="context_length_exceeded")
    return Job(prompt=prompt_ids, variant=variant, max_tokens=want, temperature=req.temperature,
               seed=req.seed, top_p=req.top_p, loop=asyncio.get_running_loop())


async def _run(service: Service, job: Job, detok: _Detok) -> AsyncIterator[tuple[str, str | None]]:
    """(text piece, None) ... then ("", finish_reason)."""
    service.batcher.submit(job)
    while True:
        kind, value = await job.out.get()
        if kind == "token":
            piece = detok.add(value)
            if piece:
                yield piece, None
            if detok.stopped:
                yield "", "stop"
                return
        elif kind == "done":
            tail = detok.flush()
            if tail:
                yield tail, None
            yield "", value
            return
        else:
            raise ApiError(500, value, type_="server_error")


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        async for c in chunks:
            yield f"data: {json.dumps(c)}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


def _usage(job: Job, detok: _Detok) -> dict:
    return {"prompt_tokens": len(job.prompt), "completion_tokens": len(detok.ids),
            "total_tokens": len(job.prompt) + len(detok.ids)}


def _stops(req: _Request) -> list[str]:
    return [req.stop] if isinstance(req.stop, str) else list(req.stop or [])


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError):
        return JSONResponse(_error_body(exc.message, type_=exc.type, code=exc.code, param=exc.param),
                            status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid request')}"
        return JSONResponse(_error_body(message, type_="invalid_request_error", param=".".join(loc) or None),
                            status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(_error_body(str(exc.detail), type_=type_), status_code=exc.status_code)


def _add_model_routes(app: FastAPI, service: Service) -> None:
    @app.get("/v1/models")
    async def list_models():
        names = await run_in_threadpool(service.registry.names)
        return {"object": "list", "data": [_model_entry(service.base_name)]
                + [_model_entry(n, service.base_name) for n in names]}

    @app.get("/health")
    async def health():
        return {"status": "ok", "base_sha256": service.base_sha256, "loaded": service.registry.loaded(),
                "resident_variant_bytes": service.registry.resident_bytes(),
                "batches": service.batcher.batches, "largest_batch": service.batcher.largest_batch}

    @app.post("/v1/variants", status_code=201)
    async def add_variant(body: AddVariant):
        if not body.name and not body.path:
            raise ApiError(400, "give `name` (a NAME.zgd in the variants directory) or `path` (a .zgd file)",
                           param="name")
        if body.name == service.base_name:
            raise ApiError(400, f"{body.name!r} is the base's id", param="name")
        try:
            v = await run_in_threadpool(service.registry.add, name=body.name, path=body.path)
        except (UnknownVariant, VariantError) as exc:
            raise _variant_error(exc) from None
        return {**_model_entry(v.name, service.base_name), "bytes": v.nbytes}

    @app.delete("/v1/variants/{name}")
    async def delete_variant(name: str):
        try:
            await run_in_threadpool(service.registry.remove, name)
        except UnknownVariant as exc:
            raise _variant_error(exc) from None
        return {"id": name, "object": "model", "deleted": True}


def _add_completion_routes(app: FastAPI, service: Service) -> None:
    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest):
        variant = await _resolve(service, req.model)
        tok = service.tokenizer
        if not getattr(tok, "chat_template", None):
            raise ApiError(400, f"the base {service.base_name!r} has no chat template; use /v1/completions",
                           param="messages")
        messages = [{"role": m.role, "content": _text(m.content)} for m in req.messages]
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # noqa: BLE001 - a template may refuse a message order
            raise ApiError(400, f"the chat template refused these messages: {exc}", param="messages") from None
        ids = tok(text, add_special_tokens=False)["input_ids"]
        job = _make_job(service, ids, req, req.max_completion_tokens or req.max_tokens, variant)
        detok = _Detok(tok, _stops(req))
        cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": cid, "created": created, "model": req.model}
        if req.stream:
            async def chunks():
                yield {**head, "object": "chat.completion.chunk",
                       "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
                async for piece, finish in _run(service, job, detok):
                    delta = {"content": piece} if piece else {}
                    yield {**head, "object": "chat.completion.chunk",
                           "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}
            return _sse(chunks())
        parts, finish = [], None
        async for piece, finish in _run(service, job, detok):
            parts.append(piece)
        return {**head, "object": "chat.completion", "usage": _usage(job, detok),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(parts)},
                             "finish_reason": finish}]}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest):
        variant = await _resolve(service, req.model)
        prompt = req.prompt
        if isinstance(prompt, list):
            if len(prompt) != 1:
                raise ApiError(400, "give one prompt per request", param="prompt")
            prompt = prompt[0]
        ids = service.tokenizer(prompt)["input_ids"]
        job = _make_job(service, ids, req, req.max_tokens, variant)
        detok = _Detok(service.tokenizer, _stops(req))
        cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        head = {"id": cid, "object": "text_completion", "created": created, "model": req.model}
        if req.stream:
            async def chunks():
                async for piece, finish in _run(service, job, detok):
                    yield {**head, "choices": [{"index": 0, "text": piece, "logprobs": None, "finish_reason": finish}]}
            return _sse(chunks())
        parts, finish = [], None
        async for piece, finish in _run(service, job, detok):
            parts.append(piece)
        return {**head, "usage": _usage(job, detok),
                "choices": [{"index": 0, "text": "".join(parts), "logprobs": None, "finish_reason": finish}]}


def create_app(service: Service) -> FastAPI:
    app = FastAPI(title="gym-serve", docs_url=None, redoc_url=None)
    _add_error_handlers(app)
    _add_model_routes(app, service)
    _add_completion_routes(app, service)
    return app
