"""`gym-serve`: personal BitDelta variants of one base behind an OpenAI-compatible HTTP API."""

from __future__ import annotations

import logging
import socket
import sys
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@app.command()
def serve(
    base: str = typer.Option(..., "--base", help="The base model: a Hugging Face directory, a hub id already in "
                                                 "your cache, or 'tiny'."),
    variants: Optional[Path] = typer.Option(None, "--variants", help="Directory of NAME.zgd variants (watched: "
                                                                     "files added or removed are picked up)."),
    host: str = typer.Option("127.0.0.1", help="Address to listen on."),
    port: int = typer.Option(8000, min=0, max=65535, help="Port (0: a free one, printed at start)."),
    max_variant_bytes: Optional[int] = typer.Option(None, min=1, help="Memory budget for loaded variants (packed "
                                                    "signs + scales); least recently used ones are unloaded "
                                                    "\\[default: no limit]."),
    max_batch: int = typer.Option(16, min=1, help="Most requests decoded in one batch."),
    batch_window_ms: float = typer.Option(5.0, min=0.0, help="How long a batch waits for more requests."),
    max_tokens: int = typer.Option(512, min=1, help="Most tokens one request may generate."),
    device: str = typer.Option("cpu", help="cpu or cuda."),
    dtype: str = typer.Option("float32", help="float32, bfloat16 or float16 for the base's weights."),
    base_name: Optional[str] = typer.Option(None, help="The `model` id of the base alone \\[default: its "
                                                       "directory name]."),
) -> None:
    """Serve a base and its personal variants: /v1/models, /v1/chat/completions, /v1/completions."""
    import uvicorn

    from zoo_gym.serving.app import create_app
    from zoo_gym.serving.service import ServeOptions, Service
    from zoo_gym.serving.variant import VariantError

    logging.basicConfig(level=logging.INFO, format="gym-serve: %(message)s", stream=sys.stderr, force=True)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Loading weights" bar in the server's log
    hf_logging.set_verbosity_error()
    if variants is not None and not variants.is_dir():
        _fail(f"--variants {variants}: no such directory")
    if dtype not in ("float32", "bfloat16", "float16"):
        _fail("--dtype must be float32, bfloat16 or float16")
    if device not in ("cpu", "cuda"):
        _fail("--device must be cpu or cuda")
    try:
        service = Service(ServeOptions(base=base, variants=str(variants) if variants else None,
                                       max_variant_bytes=max_variant_bytes, window_ms=batch_window_ms,
                                       max_batch=max_batch, max_tokens=max_tokens, device=device, dtype=dtype,
                                       base_name=base_name))
    except (VariantError, OSError) as exc:
        _fail(str(exc))
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # connections queue from now on, so a client may connect as soon as the line below is out
    except OSError as exc:
        _fail(f"cannot listen on {host}:{port}: {exc.strerror}", 1)
    bound = sock.getsockname()[1]
    service.start()
    typer.echo(f"gym-serve: listening on http://{host}:{bound} (base {service.base_name}, "
               f"{len(service.registry.names())} variant(s))", err=True)
    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level="warning"))
    try:
        server.run(sockets=[sock])
    finally:
        service.stop()
