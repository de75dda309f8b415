"""The Try it view's API: `gym-client pull` of the current checkpoint (the export: a Hugging Face directory or
a GGUF file), a `gym-serve` child over it and the join's variants, and chat through a gym-serve's API (that
one, or one already running at a URL the page gives)."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, HTTPException
from pydantic import BaseModel, Field

from zoo_gym.client.webui.routes_join import Values, connection

_LISTENING = re.compile(r"listening on (http://\S+?) ")
CHAT_TOKENS = 48


class Chat(BaseModel):
    url: str = ""
    model: str
    prompt: str = Field(min_length=1, max_length=4000)


class Pull(Values):
    format: str = "hf"


def _serve_url(console) -> str | None:
    child = console.serve.child
    if child is None or not child.running:
        return None
    found = [m[1] for line in child.lines() if (m := _LISTENING.search(line))]
    return found[-1] if found else None


def _url(console, given: str) -> str:
    url = (given or "").strip().rstrip("/") or _serve_url(console)
    if not url:
        raise HTTPException(409, "no gym-serve: start one over the pulled checkpoint, or give its URL")
    if not url.startswith(("http://", "https://")):
        raise HTTPException(400, f"{url}: give gym-serve's URL, e.g. http://127.0.0.1:8000")
    return url


async def _gym_serve(method: str, url: str, **kwargs) -> dict:
    try:
        async with httpx.AsyncClient(timeout=120) as http:
            r = await http.request(method, url, **kwargs)
    except httpx.HTTPError as exc:
        raise HTTPException(502, f"error: gym-serve at {url} did not answer: {type(exc).__name__}") from None
    doc = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
    if r.status_code >= 400:
        err = doc.get("error") if isinstance(doc.get("error"), dict) else {}
        raise HTTPException(502, f"error: gym-serve: {err.get('message') or r.status_code}")
    return doc


def _add_pull(app: FastAPI, console) -> None:
    @app.post("/api/pull", status_code=201)
    async def pull(body: Pull):
        conn = connection(console, body.values)
        if body.format not in ("hf", "gguf"):
            raise HTTPException(400, "format must be hf or gguf")
        out = console.directory / "models" / time.strftime("%Y%m%d-%H%M%S")
        args = ["pull", str(out), "--server", conn["server"], "--json", "--quiet", "--format", body.format]
        args += ["--root-certificates", conn["root_certificates"]] if conn["root_certificates"] else []
        args += ["--insecure"] if conn["insecure"] else []
        args += ["--workdir", str(body.values["workdir"])] if body.values.get("workdir") else []
        console.pull.start(console.client_argv(*args), out.with_name(out.name + ".log"), env=console.env,
                           what=f"gym-client pull {out}")
        return {"out": str(out)}

    @app.get("/api/pull")
    async def pull_view():
        child = console.pull.child
        return child.view() if child is not None else {"running": False, "result": None, "lines": []}


def _add_serve(app: FastAPI, console) -> None:
    @app.post("/api/serve", status_code=201)
    async def serve(body: Values):
        pulled = console.pull.child.result() if console.pull.child is not None else None
        base = (pulled or {}).get("out") or (pulled or {}).get("path")
        if not base:
            raise HTTPException(409, "pull the current checkpoint first (a Hugging Face directory)")
        home = Path(body.values.get("workdir") or console.default_home)
        (home / "variants").mkdir(parents=True, exist_ok=True)
        import sys

        cmd = [sys.executable, "-m", "zoo_gym.serving", "--base", str(base), "--variants", str(home / "variants"),
               "--port", "0", "--max-tokens", str(CHAT_TOKENS), "--base-name", f"checkpoint-round-{pulled['round']}"]
        console.serve.start(cmd, console.directory / "gym-serve", env=console.env, what=f"gym-serve {base}")
        return {"base": str(base)}

    @app.post("/api/serve/stop")
    async def serve_stop():
        child = console.serve.child
        if child is None or not child.running:
            raise HTTPException(409, "no gym-serve is running")
        child.stop()
        return {"stopping": True}

    @app.get("/api/serve")
    async def serve_view():
        child = console.serve.child
        return {"url": _serve_url(console), "running": bool(child and child.running),
                "lines": child.lines()[-5:] if child else []}


def _add_chat(app: FastAPI, console) -> None:
    @app.get("/api/models")
    async def models(url: str = ""):
        base = _url(console, url)
        doc = await _gym_serve("GET", f"{base}/v1/models")
        return {"url": base, "models": [m.get("id") for m in doc.get("data", [])]}

    @app.post("/api/chat")
    async def chat(body: Chat):
        base = _url(console, body.url)
        payload: dict[str, Any] = {"model": body.model, "max_tokens": CHAT_TOKENS, "temperature": 0,
                                   "messages": [{"role": "user", "content": body.prompt}]}
        doc = await _gym_serve("POST", f"{base}/v1/chat/completions", json=payload)
        return {"model": body.model, "reply": doc["choices"][0]["message"]["content"]}


def add(app: FastAPI, console) -> None:
    _add_pull(app, console)
    _add_serve(app, console)
    _add_chat(app, console)
