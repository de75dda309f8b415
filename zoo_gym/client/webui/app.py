"""The console's HTTP side: a static page (static/, no CDN, no inline script) and the JSON API it draws from.

Join: the form's fields (fields.py), an upload bounded in bytes, a preview that runs `gym-client join --dry-run`
(its JSON, or its one error line with the row and field), a start that runs `gym-client join --json` (409 while
one runs). Rounds: the server's RoundInfo and the join's progress. Rewards: `fetch_rewards(verify=True)`, the
check of `gym-client rewards --verify`. Try it: `gym-client pull`, a `gym-serve` child over the pulled
checkpoint and one over the base of the variant kept last, both stopped with the console; chat with each.
Every error is one line (``{"detail": "..."}``), never a traceback; only the Host names given are answered
(no DNS rebinding), and the contributor's key is only ever a path here: the CLI and fetch_rewards read it.
"""

from __future__ import annotations

import os
import sys
from contextlib import asynccontextmanager
from pathlib import Path

import click
from fastapi import FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles
from starlette.middleware.trustedhost import TrustedHostMiddleware

from zoo_gym.client.webui import routes_join, routes_try
from zoo_gym.client.webui.fields import FieldError
from zoo_gym.client.webui.jobs import Busy, Slot
from zoo_gym.client.webui.routes_try import CHAT_TOKENS
HERE = Path(__file__).parent
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
       "base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
DEFAULT_MAX_UPLOAD = 64 << 20


class Console:
    """What the routes share: the join command, where the console keeps its files, the children it runs."""

    def __init__(self, join_command: click.Command, *, directory: Path, default_home: Path,
                 max_upload_bytes: int = DEFAULT_MAX_UPLOAD) -> None:
        self.join_command, self.directory, self.default_home = join_command, directory, default_home
        self.max_upload_bytes = max_upload_bytes
        self.join, self.pull = Slot("join"), Slot("pull")
        self.serve, self.serve_variant = Slot("gym-serve"), Slot("gym-serve")  # the checkpoint's, the variant's
        self.panes: dict[str, dict] = {}  # what the Try it view's two chat panes show (routes_try)
        self.env = {**os.environ, "ZOO_GYM_HEARTBEAT_SECONDS": "0", "PYTHONUNBUFFERED": "1"}

    def client_argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "zoo_gym.client", *args]

    def serve_argv(self, base: Path | str, variants: Path, base_name: str) -> list[str]:
        return [sys.executable, "-m", "zoo_gym.serving", "--base", str(base), "--variants", str(variants),
                "--port", "0", "--max-tokens", str(CHAT_TOKENS), "--base-name", base_name]

    def serving(self) -> bool:
        return any(s.child is not None and s.child.running for s in (self.serve, self.serve_variant))

    def stop_serving(self, grace: float = 15.0) -> None:
        """Stop both gym-serve children: Ctrl-C, then SIGKILL after `grace` seconds (the page's stop, the exit)."""
        for slot in (self.serve, self.serve_variant):
            if slot.child is not None:
                slot.child.end(grace)


def _headers(app: FastAPI) -> None:
    @app.middleware("http")
    async def security_headers(request: Request, call_next):
        response = await call_next(request)
        response.headers.setdefault("content-security-policy", CSP)
        response.headers.setdefault("x-content-type-options", "nosniff")
        response.headers.setdefault("referrer-policy", "no-referrer")
        response.headers.setdefault("x-frame-options", "DENY")
        response.headers.setdefault("cache-control", "no-store")
        return response


def _one_line(text: str) -> str:
    return " ".join(str(text).split()) or "error"


def _errors(app: FastAPI) -> None:
    @app.exception_handler(HTTPException)
    async def _http(_: Request, exc: HTTPException):
        return JSONResponse({"detail": _one_line(exc.detail)}, status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError):
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return JSONResponse({"detail": _one_line(f"{where}: {first.get('msg', 'invalid request')}")},
                            status_code=422)

    @app.exception_handler(FieldError)
    async def _field(_: Request, exc: FieldError):
        return JSONResponse({"detail": _one_line(exc)}, status_code=400)

    @app.exception_handler(Busy)
    async def _busy(_: Request, exc: Busy):
        return JSONResponse({"detail": _one_line(exc)}, status_code=409)

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception):
        return JSONResponse({"detail": _one_line(f"internal error: {type(exc).__name__}: {exc}")}, status_code=500)


def create_app(join_command: click.Command, *, directory: Path, default_home: Path,
               max_upload_bytes: int = DEFAULT_MAX_UPLOAD,
               allowed_hosts: tuple[str, ...] = ("127.0.0.1", "localhost", "::1")) -> FastAPI:
    """The console over `join_command` (gym-client's click `join`), keeping its files under `directory`."""
    console = Console(join_command, directory=directory, default_home=default_home,
                      max_upload_bytes=max_upload_bytes)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        try:
            yield
        finally:  # the console exits: its gym-serve children go with it (a join it started goes on)
            await run_in_threadpool(console.stop_serving)

    app = FastAPI(title="gym-client webui", docs_url=None, redoc_url=None, openapi_url="/api/openapi.json",
                  lifespan=lifespan)
    app.state.console = console
    _errors(app)
    _headers(app)
    app.add_middleware(TrustedHostMiddleware, allowed_hosts=list(allowed_hosts))
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    @app.get("/", include_in_schema=False)
    async def index():
        return FileResponse(HERE / "static" / "index.html")

    routes_join.add(app, console)
    routes_try.add(app, console)
    return app
