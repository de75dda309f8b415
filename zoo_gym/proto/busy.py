"""The server's "busy, retry later" answer: RESOURCE_EXHAUSTED whose message starts with `BUSY`.

RESOURCE_EXHAUSTED also means "this request is too big" (a payload or chunk over the limit), which no
retry can fix; the marker tells the two apart, so a client retries only the busy case.
"""

from __future__ import annotations

import grpc

BUSY = "server busy"


def busy_message(reason: str) -> str:
    """The message for a refusal that a later retry can get past."""
    return f"{BUSY}: {reason}; retry later"


def is_busy(exc: grpc.RpcError) -> bool:
    """True when the server refused only because it is at capacity (retry with backoff)."""
    code = exc.code() if callable(getattr(exc, "code", None)) else None
    return code == grpc.StatusCode.RESOURCE_EXHAUSTED and (exc.details() or "").startswith(BUSY)
