"""The Try it view's API: `gym-client pull` of the current checkpoint (the export: a Hugging Face directory or
a GGUF file), a `gym-serve` child over it (pane a, or one already running at a URL the page gives) and, when
the contributor kept a variant, a second one over the base that variant was trained on (pane b,
variants.py); chat goes through each pane's gym-serve API and names the model gym-serve says answered."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
from fastapi import FastAPI, HTTPException
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, Field

from zoo_gym.client.webui import variants
from zoo_gym.client.webui.routes_join import Values, connection

_LISTENING = re.compile(r"listening on (http://\S+?) ")
CHAT_TOKENS = 48


class Chat(BaseModel):
    url: str = ""
    model: str
    prompt: str = Field(min_length=1, max_length=4000)
    pane: str = "a"  # a: the current checkpoint's gym-serve (or the URL given); b: the variant's


class Pull(Values):
    format: str = "hf"


def _child_url(child) -> str | None:
    if child is None or not child.running:
        return None
    found = [m[1] for line in child.lines() if (m := _LISTENING.search(line))]
    return found[-1] if found else None


def _url(console, given: str, pane: str = "a") -> str:
    if pane not in ("a", "b"):
        raise HTTPException(400, "pane must be a (the checkpoint) or b (your variant)")
    if pane == "b":
        url = _child_url(console.serve_variant.child)
        if not url:
            b = _pane(console, "b", console.serve_variant.child)
            raise HTTPException(409, b["error"] or b.get("none") or "no gym-serve over your variant: Serve it")
        return url
    url = (given or "").strip().rstrip("/") or _child_url(console.serve.child)
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


def _serve_variant(console, home: Path) -> dict:
    """Start the gym-serve over the newest kept variant's own base; what the right pane shows."""
    try:
        mine = variants.newest(home)
        if mine is None:
            return {"none": variants.NO_VARIANT}
        base = mine.base_dir(home)
    except variants.NoBase as exc:
        return {"error": f"error: {exc}"}
    cmd = console.serve_argv(base, home / "variants", f"checkpoint-{mine.checkpoint_sha256[:12]}")
    console.serve_variant.start(cmd, console.directory / "gym-serve-variant", env=console.env,
                                what=f"gym-serve {base} (your variant {mine.name})")
    return {"label": mine.label, "model": mine.name, "base": str(base)}


def _pane(console, pane: str, child) -> dict:
    lines = child.lines() if child else []
    return {**console.panes.get(pane, {}), "url": _child_url(child), "running": bool(child and child.running),
            "lines": lines[-5:], "error": console.panes.get(pane, {}).get("error")
            or next((x for x in reversed(lines) if x.startswith("error")), None)}


def _add_serve(app: FastAPI, console) -> None:
    @app.post("/api/serve", status_code=201)
    async def serve(body: Values):
        """gym-serve over the pulled checkpoint (left pane) and, when a variant was kept, over its base (right)."""
        pulled = console.pull.child.result() if console.pull.child is not None else None
        base = (pulled or {}).get("out") or (pulled or {}).get("path")
        if not base:
            raise HTTPException(409, "pull the current checkpoint first (a Hugging Face directory)")
        if console.serving():
            raise HTTPException(409, "gym-serve is already running; stop it first")
        home = Path(body.values.get("workdir") or console.default_home)
        (home / "variants").mkdir(parents=True, exist_ok=True)
        name = f"checkpoint-round-{pulled['round']}"
        console.serve.start(console.serve_argv(base, home / "variants", name), console.directory / "gym-serve",
                            env=console.env, what=f"gym-serve {base}")
        console.panes = {"a": {"label": f"checkpoint round {pulled['round']}", "model": name, "base": str(base)},
                         "b": _serve_variant(console, home)}
        return {"base": str(base), "panes": console.panes}

    @app.post("/api/serve/stop")
    async def serve_stop():
        """Both gym-serve children (the page's stop button; the console's exit does the same)."""
        if not console.serving():
            raise HTTPException(409, "no gym-serve is running")
        await run_in_threadpool(console.stop_serving)
        return {"stopped": True}

    @app.get("/api/serve")
    async def serve_view():
        a = _pane(console, "a", console.serve.child)
        b = _pane(console, "b", console.serve_variant.child) if "b" in console.panes else None
        return {"url": a["url"], "running": console.serving(), "lines": a["lines"], "panes": {"a": a, "b": b}}


def _add_chat(app: FastAPI, console) -> None:
    @app.get("/api/models")
    async def models(url: str = "", pane: str = "a"):
        base = _url(console, url, pane)
        doc = await _gym_serve("GET", f"{base}/v1/models")
        return {"url": base, "models": [m.get("id") for m in doc.get("data", [])]}

    @app.post("/api/chat")
    async def chat(body: Chat):
        base = _url(console, body.url, body.pane)
        payload: dict[str, Any] = {"model": body.model, "max_tokens": CHAT_TOKENS, "temperature": 0,
                                   "messages": [{"role": "user", "content": body.prompt}]}
        doc = await _gym_serve("POST", f"{base}/v1/chat/completions", json=payload)
        # the model gym-serve says answered (its response names it), not the one asked for
        return {"model": doc.get("model"), "asked": body.model, "reply": doc["choices"][0]["message"]["content"]}


def add(app: FastAPI, console) -> None:
    _add_pull(app, console)
    _add_serve(app, console)
    _add_chat(app, console)
