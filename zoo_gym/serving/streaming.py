"""Server-Sent Events of a completion: OpenAI's ``chat.completion.chunk`` / ``text_completion`` chunks, then
(``stream_options.include_usage``) one chunk with no choices and the usage, then ``data: [DONE]``. Each
chunk carries the log-probs of the tokens its text came from (when asked). An
error after the stream began is sent as one ``data: {"error": ...}`` event before ``[DONE]``.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable

from fastapi.responses import StreamingResponse

from zoo_gym.serving.edge import error_body
from zoo_gym.serving.requests import ApiError

log = logging.getLogger("zoo_gym.serving")


def sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def body():
        try:
            async for c in chunks:
                yield f"data: {json.dumps(c)}\n\n"
        except ApiError as exc:
            yield f"data: {json.dumps(error_body(exc.message, type_=exc.type, code=exc.code, param=exc.param))}\n\n"
        except Exception as exc:  # noqa: BLE001 - the response has begun: tell the client, keep serving
            log.exception("a streamed completion failed")
            yield f"data: {json.dumps(error_body(f'internal error: {type(exc).__name__}', type_='server_error'))}\n\n"
        yield "data: [DONE]\n\n"
    return StreamingResponse(body(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def stream_chat(head: dict, pieces, usage: Callable[[], dict], options, fmt=None) -> AsyncIterator[dict]:
    """``fmt``: log-prob entries -> a chunk's ``logprobs`` (None: not asked for)."""
    with_usage = bool(options and options.include_usage)
    extra = {"usage": None} if with_usage else {}
    chunk = {**head, "object": "chat.completion.chunk"}
    yield {**chunk, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                 "finish_reason": None}], **extra}
    async for piece, finish, entries in pieces:
        delta = {"content": piece} if piece else {}
        logprobs = fmt(entries) if fmt and entries else None
        yield {**chunk, "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish}],
               **extra}
    if with_usage:
        yield {**chunk, "choices": [], "usage": usage()}


async def stream_completion(head: dict, pieces, usage: Callable[[], dict], options, fmt=None
                            ) -> AsyncIterator[dict]:
    with_usage = bool(options and options.include_usage)
    extra = {"usage": None} if with_usage else {}
    async for piece, finish, entries in pieces:
        logprobs = fmt(entries) if fmt and entries else None
        yield {**head, "choices": [{"index": 0, "text": piece, "logprobs": logprobs, "finish_reason": finish}],
               **extra}
    if with_usage:
        yield {**head, "choices": [], "usage": usage()}
