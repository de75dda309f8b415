"""The request bodies gym-serve accepts, validated strictly at the edge (pydantic, JSON mode).

Every value is bounded and typed (strict booleans and integers, seeds 0..2**64-1). OpenAI options gym-serve
does not implement are refused (``unsupported``) unless they carry their neutral value; unknown fields are
refused too. ``parse`` turns a body into a model or an ApiError naming the parameter (``param: null`` for
a body that is not a JSON object).
"""

from __future__ import annotations

import json
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError

MAX_SEED = 2**64 - 1
STRICT = ConfigDict(strict=True, extra="allow")

# OpenAI options not implemented here, with the values that mean "not used" (compared as JSON text, so
# `0` is not `false`).
NEUTRAL: dict[str, tuple] = {
    "frequency_penalty": (0, 0.0, None), "presence_penalty": (0, 0.0, None), "logit_bias": (None, {}),
    "tools": (None, []), "tool_choice": (None, "none"),
    "functions": (None, []), "function_call": (None, "none"), "parallel_tool_calls": (None, True, False),
    "response_format": (None, {"type": "text"}), "best_of": (None, 1), "echo": (None, False),
    "suffix": (None, ""), "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,),
    "reasoning_effort": (None,), "web_search_options": (None,), "service_tier": (None, "auto", "default"),
}
IGNORED = {"user", "metadata", "store"}  # accepted, no effect on the answer


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, code: str | None = None, param: str | None = None,
                 type_: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param, self.type = status, message, code, param, type_


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    include_usage: bool = False


class _Request(BaseModel):
    model_config = STRICT

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    stop: str | list[str] | None = Field(None, max_length=4)
    n: int = Field(1, ge=1, le=1)


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ContentPart] | None = None


class ChatRequest(_Request):
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)

    def logprob_k(self) -> int | None:
        """How many alternatives each token's log-prob comes with (None: no log-probs)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Request):
    prompt: str | list[str] = Field(min_length=0)
    max_tokens: int | None = Field(16, ge=1)  # OpenAI's default for /v1/completions
    logprobs: int | None = Field(None, ge=0, le=5)

    def logprob_k(self) -> int | None:
        return self.logprobs


class AddVariant(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    name: str | None = Field(None, max_length=256)
    path: str | None = Field(None, max_length=4096)


M = TypeVar("M", bound=BaseModel)


def _first_error(exc: ValidationError) -> ApiError:
    first = exc.errors(include_url=False)[0]
    loc = [str(x) for x in first.get("loc", ())]
    if not loc:
        if first.get("type") == "json_invalid":
            return ApiError(400, f"the body is not valid JSON: {first.get('msg', '')}"
                                 f" (send a JSON object, Content-Type: application/json)")
        return ApiError(400, "the body must be a JSON object")
    # a union's branch name (e.g. `str`, `list[...]`) in the location is noise for a client
    loc = [x for x in loc if not (x[:1].islower() and ("[" in x or x in ("str", "int", "float", "bool")))
           and x not in ("function-after", "union")]
    param = ".".join(loc) or None
    return ApiError(400, f"{param or 'body'}: {first.get('msg', 'invalid value')}", param=param)


def parse(model: type[M], body: bytes) -> M:
    """The body as ``model``, or ApiError (400) naming the first bad or unsupported parameter."""
    try:
        req = model.model_validate_json(body or b"null")
    except ValidationError as exc:
        raise _first_error(exc) from None
    for key, value in (req.model_extra or {}).items():
        if key in IGNORED:
            continue
        if key not in NEUTRAL:
            raise ApiError(400, f"unrecognized request argument `{key}`", param=key)
        if json.dumps(value) not in {json.dumps(v) for v in NEUTRAL[key]}:
            raise ApiError(400, f"`{key}` is not supported by gym-serve (leave it out)", param=key)
    return req


def text_of(content: Any) -> str:
    """A message's text; ApiError for a part that is not text (images, audio)."""
    if content is None or isinstance(content, str):
        return content or ""
    for part in content:
        if part.type != "text":
            raise ApiError(400, f"content parts of type {part.type!r} are not supported (text only)",
                           param="messages")
    return "".join(part.text or "" for part in content)
