"""`gym-serve`: personal BitDelta variants of one base behind an OpenAI-compatible HTTP API.

Its settings are ServeSettings' fields (zoo_gym/serving/settings.py): flags, ``--config`` file keys and
``ZOO_GYM_<KEY>`` environment variables; precedence flag > environment > file > default.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
from pathlib import Path
from typing import Any, Optional

import typer

from zoo_gym.serving.settings import ServeSettings
from zoo_gym.settings import SettingError, norm_key, resolve, with_settings
from zoo_gym.settings_file import SettingsFileError, read_settings_file

app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


def _fail(message: str, code: int = 2) -> None:
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


def _settings(config: Optional[Path], flags: dict[str, Any]) -> ServeSettings:
    """The settings from the flags, ZOO_GYM_<KEY>, the --config file (sections only for readability), defaults."""
    try:
        raw = read_settings_file(config) if config else {}
        file_values: dict[str, Any] = {}
        for key, value in raw.items():
            section = value if isinstance(value, dict) else {key: value}
            file_values.update({norm_key(k): v for k, v in section.items()})
        settings = resolve(ServeSettings, file_values=file_values, environ=os.environ, flags=flags)
    except (SettingsFileError, SettingError) as exc:
        _fail(f"--config {exc}" if isinstance(exc, SettingsFileError) else str(exc))
    if settings.base is None:
        _fail("no base model: give --base (or ZOO_GYM_BASE, or `base` in --config)")
    if settings.variants is not None and not Path(settings.variants).is_dir():
        _fail(f"--variants {settings.variants}: no such directory")
    return settings


def _quiet_logs() -> None:
    logging.basicConfig(level=logging.INFO, format="gym-serve: %(message)s", stream=sys.stderr, force=True)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Loading weights" bar in the server's log
    hf_logging.set_verbosity_error()


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(2048)  # connections queue from now on, so a client may connect as soon as the line below is out
    except OSError as exc:
        _fail(f"cannot listen on {host}:{port}: {exc.strerror}", 1)
    return sock


@app.command()
@with_settings(ServeSettings)
def serve(
    config: Optional[Path] = typer.Option(None, "--config", help="Settings from a TOML or YAML file (keys as the "
                                          "flags, dashes or underscores); flags and ZOO_GYM_<KEY> win over it."),
    *,
    settings_flags: dict,
) -> None:
    """Serve a base and its personal variants: /v1/models, /v1/chat/completions, /v1/completions."""
    import uvicorn

    from zoo_gym.serving.app import create_app
    from zoo_gym.serving.service import ServeOptions, Service
    from zoo_gym.serving.variant import VariantError

    s = _settings(config, settings_flags)
    _quiet_logs()
    try:
        service = Service(ServeOptions(base=s.base, variants=s.variants, max_variant_bytes=s.max_variant_bytes,
                                       window_ms=s.batch_window_ms, max_batch=s.max_batch, max_tokens=s.max_tokens,
                                       device=s.device, dtype=s.dtype, base_name=s.base_name))
    except (VariantError, OSError) as exc:
        _fail(str(exc))
    sock = _listen(s.host, s.port)
    bound = sock.getsockname()[1]
    service.start()
    typer.echo(f"gym-serve: listening on http://{s.host}:{bound} (base {service.base_name}, "
               f"{len(service.registry.names())} variant(s))", err=True)
    server = uvicorn.Server(uvicorn.Config(create_app(service), log_level="warning"))
    try:
        server.run(sockets=[sock])
    finally:
        service.stop()
