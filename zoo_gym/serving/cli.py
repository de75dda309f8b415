"""`gym-serve`: personal BitDelta variants of one base behind an OpenAI-compatible HTTP API.

Its settings are ServeSettings' fields (zoo_gym/serving/settings.py): flags, ``--config`` file keys and
``ZOO_GYM_<KEY>`` environment variables; precedence flag > environment > file > default.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any, Optional

import typer

from zoo_gym.cli_help import Typer
from zoo_gym.serving.settings import ServeSettings
from zoo_gym.settings import SettingError, norm_key, resolve, with_settings
from zoo_gym.settings_file import SettingsFileError, read_settings_file

app = Typer(add_completion=False, pretty_exceptions_enable=False)
log = logging.getLogger("zoo_gym.serving")
_JSON = [False]  # --log-format json, once the settings are known


def _fail(message: str, code: int = 2) -> None:
    if _JSON[0]:
        from zoo_gym.serving.logs import json_line

        typer.echo(json_line(f"error: {message}"), err=True)
    else:
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

    from zoo_gym.serving import logs

    s = _settings(config, settings_flags)
    _JSON[0] = s.log_format == "json"
    logs.setup(s.log_format)
    try:
        service = Service(ServeOptions(base=s.base, variants=s.variants, max_variant_bytes=s.max_variant_bytes,
                                       window_ms=s.batch_window_ms, max_batch=s.max_batch, max_tokens=s.max_tokens,
                                       device=s.device, dtype=s.dtype, base_name=s.base_name))
    except (VariantError, OSError) as exc:
        _fail(str(exc))
    sock = _listen(s.host, s.port)
    bound = sock.getsockname()[1]
    service.start()
    line = (f"listening on http://{s.host}:{bound} (base {service.base_name}, "
            f"{len(service.registry.names())} variant(s))")
    if _JSON[0]:
        log.info(line)
    else:
        typer.echo(f"gym-serve: {line}", err=True)
    application = create_app(service, api_key=s.api_key, max_body_bytes=s.max_body_bytes)
    config = (uvicorn.Config(application, log_config=None, log_level="info", use_colors=False) if _JSON[0]
              else uvicorn.Config(application, log_level="warning"))
    server = uvicorn.Server(config)
    try:
        server.run(sockets=[sock])
    finally:
        service.stop()
