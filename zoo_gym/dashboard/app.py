"""The read-only web dashboard: server-rendered pages, the JSON API they are drawn from, and /metrics.

FastAPI with Jinja2 templates and inline SVG charts drawn in Python (charts.py): every asset is ours,
nothing loads from a CDN, and the pages work without JavaScript. The page refreshes itself (a meta
refresh) while a round is open or aggregating. Every query parameter is bounded (422, never a database
error); every response, an internal error's 500 too (``{"detail": "internal error"}``, no traceback), carries a
strict CSP (no inline script or style), nosniff, no-referrer, no framing, and HSTS over TLS. No Swagger UI
(it loads from a CDN): the schema is at /api/openapi.json. Given a token, every route (pages, API, /metrics,
static files) answers 401 unless the request carries ``Authorization: Bearer <token>``.
"""

from __future__ import annotations

import hmac
import json
import re
import time
from pathlib import Path

from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from fastapi.templating import Jinja2Templates

from zoo_gym.server.store import queries
from zoo_gym.dashboard.charts import line_chart

HERE = Path(__file__).parent
_CID = re.compile(r"^[0-9a-f]{32}$")
MAX_ROUND_ID = 2**31 - 1  # PostgreSQL INTEGER: a larger bound is "integer out of range" there
CSP = ("default-src 'none'; style-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; "
       "frame-ancestors 'none'")
HEADERS = [(b"content-security-policy", CSP.encode()), (b"x-content-type-options", b"nosniff"),
           (b"referrer-policy", b"no-referrer"), (b"x-frame-options", b"DENY")]
HSTS = (b"strict-transport-security", b"max-age=31536000")


class SecurityHeaders:
    """ASGI middleware: HEADERS on every HTTP response (errors included), HSTS when served over TLS."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        extra = HEADERS + [HSTS] if scope.get("scheme") == "https" else HEADERS

        async def send_with_headers(message):
            if message["type"] == "http.response.start":
                names = {k.lower() for k, _ in message.get("headers", [])}
                message = {**message, "headers": [*message.get("headers", []),
                                                  *(h for h in extra if h[0] not in names)]}
            await send(message)

        return await self.app(scope, receive, send_with_headers)


class BearerAuth:
    """ASGI middleware: 401 with a one-line JSON error unless ``Authorization: Bearer <token>`` carries `token`
    (compared in constant time)."""

    def __init__(self, app, token: str) -> None:
        self.app = app
        self._token = token.encode()

    def _refusal(self, scope) -> str | None:
        given = dict(scope.get("headers") or ()).get(b"authorization")
        if given is None:
            return "this dashboard needs the header 'Authorization: Bearer <token>' (its --dashboard-token-file)"
        scheme, _, token = given.strip().partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self._token):
            return "the bearer token does not match the server's --dashboard-token-file"
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "lifespan" and (why := self._refusal(scope)) is not None:
            if scope["type"] != "http":  # a websocket: refused before it is accepted
                return await send({"type": "websocket.close", "code": 1008})
            body = json.dumps({"detail": why}).encode()
            await send({"type": "http.response.start", "status": 401, "headers": [
                (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                (b"www-authenticate", b'Bearer realm="zoo-gym dashboard"'), (b"cache-control", b"no-store")]})
            return await send({"type": "http.response.body", "body": body})
        return await self.app(scope, receive, send)


class _Dashboard(FastAPI):
    """FastAPI with SecurityHeaders outside Starlette's ServerErrorMiddleware, which answers an uncaught
    exception's 500 itself, outside every middleware added with ``add_middleware``; and, given a
    `bearer_token`, BearerAuth inside SecurityHeaders (a 401 carries the headers too)."""

    bearer_token: str | None = None

    def build_middleware_stack(self):
        stack = super().build_middleware_stack()
        return SecurityHeaders(BearerAuth(stack, self.bearer_token) if self.bearer_token else stack)


async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"detail": "internal error"}, status_code=500)


def _templates() -> Jinja2Templates:
    templates = Jinja2Templates(directory=HERE / "templates")
    templates.env.filters["short"] = lambda s, n=12: (s or "")[:n]
    templates.env.filters["when"] = lambda t: time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(t)) if t else "-"
    templates.env.filters["num"] = lambda x, fmt="{:.4f}": "-" if x is None else fmt.format(x)
    return templates


def _index_context(state, check, dp_target_epsilon: float | None, refresh_seconds: int) -> dict:
    summary = {**queries.summary(state), "dp_target_epsilon": dp_target_epsilon}
    loss = [(p["round"], p["heldout_loss"]) for p in queries.loss_series(state) if p["heldout_loss"] is not None]
    eps = [(p["round"], p["epsilon_total"]) for p in queries.privacy_series(state)]
    return {
        "summary": summary, "rounds": queries.rounds(state, limit=50),
        "loss_chart": line_chart(loss, chart_id="loss-chart", title="Held-out loss per round",
                                 y_label="held-out loss"),
        "privacy_chart": line_chart(eps, chart_id="privacy-chart", title="Privacy budget spent",
                                    y_label="epsilon spent", limit=dp_target_epsilon,
                                    limit_label=f"target {dp_target_epsilon}" if dp_target_epsilon else ""),
        "leaderboard": queries.leaderboard(state, limit=50), "ledger": queries.ledger(state, limit=20),
        "verification": check.report(), "checkpoints": queries.checkpoints(state, limit=20),
        "refresh": refresh_seconds if summary["current_state"] in ("open", "aggregating") else None}


def create_app(state, *, registry=None, dp_target_epsilon: float | None = None, refresh_seconds: int = 5,
               token: str | None = None) -> FastAPI:
    """The dashboard over `state` (a ServerState; only read); /metrics serves `registry` when given; every
    route needs `token` as a bearer token when given."""
    app = _Dashboard(title="Zoo Gym federation", docs_url=None, redoc_url=None, openapi_url="/api/openapi.json",
                     exception_handlers={Exception: _internal_error})
    app.bearer_token = token
    templates = _templates()
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")
    if registry is not None:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        @app.get("/metrics", include_in_schema=False)
        def metrics() -> Response:  # a route, not a mount: a mount answers /metrics with a redirect
            return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)
    check = app.state.ledger_check = queries.LedgerCheck(state)  # DashboardServer.start warms it

    def known(contributor_id: str) -> dict:
        if not _CID.match(contributor_id):
            raise HTTPException(404, "a contributor id is 32 lowercase hex characters")
        found = queries.contributor(state, contributor_id)
        if found is None:
            raise HTTPException(404, f"no contributor {contributor_id} is registered")
        return found

    @app.get("/api/summary")
    def api_summary() -> dict:
        """Current round, its submissions, rounds published, epsilon spent and its target, last loss."""
        return {**queries.summary(state), "dp_target_epsilon": dp_target_epsilon}

    @app.get("/api/rounds")
    def api_rounds(limit: int = Query(50, ge=1, le=1000),
                   before: int | None = Query(None, ge=1, le=MAX_ROUND_ID)) -> list[dict]:
        """Rounds, newest first: state, deadline, submissions, accepted/refused with reasons, times."""
        return queries.rounds(state, limit=limit, before=before)

    @app.get("/api/loss")
    def api_loss() -> list[dict]:
        """Held-out loss of every published checkpoint, by round."""
        return queries.loss_series(state)

    @app.get("/api/privacy")
    def api_privacy() -> dict:
        """Epsilon spent after each DP round, and the target (--dp-target-epsilon)."""
        return {"target": dp_target_epsilon, "rounds": queries.privacy_series(state)}

    @app.get("/api/leaderboard")
    def api_leaderboard(limit: int = Query(100, ge=1, le=10_000)) -> list[dict]:
        """Contributors by balance: display name, balance, reputation, rounds contributed."""
        return queries.leaderboard(state, limit=limit)

    @app.get("/api/ledger")
    def api_ledger(limit: int = Query(50, ge=1, le=10_000)) -> dict:
        """The newest ledger entries and the verification of the whole chain (as `ledger verify`)."""
        return {"verification": check.report(), "entries": queries.ledger(state, limit=limit)}

    @app.get("/api/checkpoints")
    def api_checkpoints(limit: int = Query(50, ge=1, le=10_000)) -> list[dict]:
        """The lineage of published checkpoints, newest first."""
        return queries.checkpoints(state, limit=limit)

    @app.get("/api/contributors/{contributor_id}")
    def api_contributor(contributor_id: str) -> dict:
        """One contributor: submissions, scores, payments and refusals."""
        return known(contributor_id)

    @app.get("/", response_class=HTMLResponse)
    def index(request: Request):
        return templates.TemplateResponse(request, "index.html",
                                          _index_context(state, check, dp_target_epsilon, refresh_seconds))

    @app.get("/contributors/{contributor_id}", response_class=HTMLResponse)
    def contributor_page(request: Request, contributor_id: str):
        return templates.TemplateResponse(request, "contributor.html", {"c": known(contributor_id)})

    return app
