"""gym-serve's ASGI edge, before any route runs: counts every request in the metrics (route template, a
refusal's too, and status), checks the API key (``Authorization: Bearer KEY`` on every /v1 route; 401) or,
without one, refuses variant management from anyone but localhost (403), and reads the body up to
``max_body_bytes`` (413 as soon as the Content-Length or the bytes received pass it), handing the app a body
already read.
"""

from __future__ import annotations

import hmac
import ipaddress
import json

from zoo_gym.serving.metrics import Metrics

BODY_METHODS = {"POST", "PUT", "PATCH", "DELETE"}


def error_body(message: str, *, type_: str, code: str | None = None, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _is_local(scope) -> bool:
    client = scope.get("client")
    try:
        return bool(client) and ipaddress.ip_address(client[0]).is_loopback
    except ValueError:
        return False


class _Refused(Exception):
    def __init__(self, status: int, message: str, code: str | None = None, type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.code, self.type = status, message, code, type_


def route_label(scope, routes) -> str:
    """The metrics label of a request: its route's template (as the router set it, else matched here for a
    request refused before routing: 401, 403, 413), or "other" for a path no route has (bounded labels)."""
    from starlette.routing import Match

    route = scope.get("route")
    if route is None:
        for candidate in routes:
            match, _ = candidate.matches(scope)
            if match != Match.NONE:  # PARTIAL: the path matched, the method did not (a 405 of that route)
                route = candidate
                break
    return getattr(route, "path", None) or "other"


class Edge:
    def __init__(self, app, *, api_key: str | None, max_body_bytes: int, metrics: Metrics, routes=()) -> None:
        self.app, self.api_key, self.max_body, self.metrics = app, api_key, max_body_bytes, metrics
        self.routes = routes  # the app's routes: a refusal is counted under the route it was meant for

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def counted_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            self._check_access(scope)
            if scope["method"] in BODY_METHODS:
                receive = await self._read_body(scope, receive)
            await self.app(scope, receive, counted_send)
        except _Refused as exc:
            await self._refuse(counted_send, exc)
        finally:
            self.metrics.requests.labels(route_label(scope, self.routes), str(status[0])).inc()

    def _check_access(self, scope) -> None:
        path, method = scope["path"], scope["method"]
        if self.api_key is not None:
            if path.startswith("/v1/") or path == "/v1":
                auth = dict(scope["headers"]).get(b"authorization", b"")
                given = auth[7:] if auth[:7].lower() == b"bearer " else b""
                if not hmac.compare_digest(given, self.api_key.encode()):
                    raise _Refused(401, "Incorrect or missing API key: send Authorization: Bearer KEY",
                                   "invalid_api_key")
        elif path.startswith("/v1/variants") and method in BODY_METHODS and not _is_local(scope):
            raise _Refused(403, "managing variants from another host needs the server to run with --api-key "
                                "(without it only localhost may add or remove variants)", "forbidden")

    async def _read_body(self, scope, receive):
        length = dict(scope["headers"]).get(b"content-length")
        too_big = _Refused(413, f"the request body is larger than this server's limit of {self.max_body} bytes "
                                "(--max-body-bytes)", "request_too_large")
        if length is not None and (not length.isdigit() or int(length) > self.max_body):
            raise too_big
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return receive
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                raise too_big
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body, sent = b"".join(chunks), [False]

        async def replay():
            if not sent[0]:
                sent[0] = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        return replay

    @staticmethod
    async def _refuse(send, exc: _Refused) -> None:
        payload = json.dumps(error_body(exc.message, type_=exc.type, code=exc.code)).encode()
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode())]
        if exc.status == 401:
            headers.append((b"www-authenticate", b"Bearer"))
        await send({"type": "http.response.start", "status": exc.status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
