"""The Join, Rounds and Rewards views' API: fields, upload, preview (--dry-run), start/stop/progress, the
round, and the verified ledger. Every start and preview runs the CLI itself, with the flags `fields.argv` builds."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.concurrency import run_in_threadpool
from pydantic import BaseModel, Field

from zoo_gym.client.webui.fields import argv, join_fields

_NAME = re.compile(r"[^A-Za-z0-9._-]+")
_DATA_SUFFIXES = (".json", ".jsonl", ".parquet", ".csv")
PREVIEW_RECORDS = 3


class Values(BaseModel):
    values: dict[str, Any] = Field(default_factory=dict)


def connection(console, values: dict[str, Any]) -> dict[str, Any]:
    """The server (its addresses: "servers"; the first: "server"), CA, --insecure and key path the form names
    (the CLI's defaults where it names none)."""
    from zoo_gym.client.connection import addresses

    given = values.get("server")
    servers = [a for v in (given if isinstance(given, list) else [given or ""]) for a in addresses(str(v))]
    if not servers:
        raise HTTPException(400, "give the server's HOST:PORT in the Join view first")
    key = values.get("key") or str(console.default_home / "contributor.pem")
    return {"server": servers[0], "servers": servers, "root_certificates": values.get("root_certificates") or None,
            "insecure": bool(values.get("insecure")), "key": key}


def _first_records(data: str) -> list:
    from zoo_gym.gym_train.sources import iter_records

    if not data or data == "builtin" or not Path(data).is_file():
        return []
    out = []
    try:
        for where, record in iter_records(data):
            out.append({"where": where, "record": record})
            if len(out) == PREVIEW_RECORDS:
                break
    except ValueError:
        pass  # the dry run says what is wrong, with its row and field
    return out


def _dry_run(console, values: dict[str, Any]) -> dict:
    flags = argv(console.join_command, values)
    cmd = console.client_argv("join", *flags, "--dry-run")
    done = subprocess.run(cmd, capture_output=True, text=True, env=console.env, timeout=300,
                          stdin=subprocess.DEVNULL)
    errors = [line for line in done.stderr.splitlines() if line.startswith("error: ")]
    warnings = [line for line in done.stderr.splitlines() if line.startswith("warning: ")]
    doc = json.loads(done.stdout) if done.returncode == 0 and done.stdout.strip() else None
    return {"ok": doc is not None, "command": ["gym-client", "join", *flags], "resolved": doc,
            "error": errors[-1] if errors else (None if doc else f"error: gym-client exited {done.returncode}"),
            "warnings": warnings, "records": _first_records(str(values.get("data") or ""))}


def _add_form(app: FastAPI, console) -> None:
    @app.get("/api/fields")
    async def fields():
        return {"fields": join_fields(console.join_command), "max_upload_bytes": console.max_upload_bytes}

    @app.put("/api/data")
    async def upload(request: Request, name: str):
        """A data file dropped on the page, bounded in bytes; its path on this machine is the --data to give."""
        clean = _NAME.sub("_", Path(name).name).lstrip(".") or "data.jsonl"
        if not clean.endswith(_DATA_SUFFIXES):
            raise HTTPException(400, f"{name}: give a {', '.join(_DATA_SUFFIXES)} file")
        limit = console.max_upload_bytes
        if int(request.headers.get("content-length") or 0) > limit:
            raise HTTPException(413, f"{name} is larger than the console's upload limit of {limit} bytes")
        folder = console.directory / "uploads"
        folder.mkdir(parents=True, exist_ok=True)
        path, size = folder / f"{time.strftime('%Y%m%d-%H%M%S')}-{clean}", 0
        with open(path, "wb") as out:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    out.close()
                    path.unlink(missing_ok=True)
                    raise HTTPException(413, f"{name} is larger than the console's upload limit of {limit} bytes")
                out.write(chunk)
        return {"path": str(path), "bytes": size}

    @app.post("/api/preview")
    async def preview(body: Values):
        return await run_in_threadpool(_dry_run, console, body.values)


def _add_join(app: FastAPI, console) -> None:
    @app.post("/api/join", status_code=201)
    async def start(body: Values):
        flags = argv(console.join_command, body.values)
        connection(console, body.values)
        folder = console.directory / "joins" / time.strftime("%Y%m%d-%H%M%S")
        child = console.join.start(console.client_argv("join", *flags, "--json"), folder, env=console.env,
                                   what=f"gym-client join {' '.join(flags)}")
        return {"command": ["gym-client", "join", *flags, "--json"], "pid": child.process.pid}

    @app.get("/api/join")
    async def view(since: int = 0):
        child = console.join.child
        return child.view(since) if child is not None else {"running": False, "lines": [], "line_count": 0,
                                                           "progress": None, "result": None}

    @app.post("/api/join/stop")
    async def stop():
        child = console.join.child
        if child is None or not child.running:
            raise HTTPException(409, "no join is running")
        child.stop()  # SIGINT: what Ctrl-C does to gym-client join in a shell
        return {"stopping": True}


def _round(conn: dict) -> dict:
    """The current round from the first of the addresses that answers (an unavailable one: the next)."""
    import grpc

    from zoo_gym.client.connection import Servers
    from zoo_gym.proto import gym_pb2

    servers = Servers(conn["servers"], root_certificates=conn["root_certificates"], insecure=conn["insecure"])
    try:
        for _ in servers.addresses:
            before = servers.index
            try:
                info = servers.GetRound(gym_pb2.GetRoundRequest(), timeout=10)
                break
            except grpc.RpcError:
                if servers.index in (before, 0):  # a refusal, not an outage; or every address tried
                    raise
    finally:
        servers.close()
    state = gym_pb2.RoundState.Name(info.state).removeprefix("ROUND_STATE_").lower()
    return {"round": info.round_id, "state": state, "deadline_unix": info.deadline_unix or None,
            "submissions": info.submissions, "min_contributors": info.min_contributors,
            "mode": info.mode or "sync", "message": info.message, "now": time.time()}


def _rewards(conn: dict) -> dict:
    from zoo_gym.client.rewards import fetch_rewards

    return fetch_rewards(conn["server"], key_path=Path(conn["key"]), contributor=None, limit=50, verify=True,
                         root_certificates=conn["root_certificates"], insecure=conn["insecure"], say=lambda _m: None)


async def _ask(fn, conn: dict) -> dict:
    """fn(conn) in a thread; a refusal or an unreachable server as the CLI's one line (502)."""
    import grpc

    try:
        return await asyncio.wait_for(run_in_threadpool(fn, conn), timeout=120)
    except grpc.RpcError as exc:
        raise HTTPException(502, f"error: the server at {conn['server']} answered {exc.code().name}: "
                                 f"{exc.details()}") from None
    except (RuntimeError, OSError, ValueError) as exc:  # RewardsError, TransportMismatch, a missing CA file
        raise HTTPException(502, f"error: {exc}") from None


def _add_server(app: FastAPI, console) -> None:
    @app.post("/api/round")
    async def round_info(body: Values):
        return await _ask(_round, connection(console, body.values))

    @app.post("/api/rewards")
    async def rewards(body: Values):
        return await _ask(_rewards, connection(console, body.values))


def add(app: FastAPI, console) -> None:
    _add_form(app, console)
    _add_join(app, console)
    _add_server(app, console)
