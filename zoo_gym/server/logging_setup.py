"""The server's log: one handler on stderr, as text or as one JSON object per line (`--log-format`).

Library chatter stays out: transformers' and huggingface_hub's progress bars ("Loading weights") are
switched off, their warnings go through this handler like everything else. The server's own logger
always produces its INFO records (the metrics time the publish phases from them); the handler's level
decides what is printed. With json, every line on stderr is one JSON object: the server's announcements
(`announce`: listening, dashboard, stopping, a one-line error), Python warnings and uncaught exceptions
included; uvicorn's ANSI `color_message` is dropped.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from zoo_gym.log_format import JsonFormatter  # gym-server's defaults: upper-case levels, extra fields, "exception"

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
_format = "text"  # as configure_logging chose: how `announce` writes


def configure_logging(*, level: str = "INFO", fmt: str = "text") -> None:
    """Replace the root handlers with one on stderr in `fmt` ("text" or "json") at `level`."""
    level = level.upper()
    if level not in LEVELS:
        raise ValueError(f"--log-level must be one of {', '.join(LEVELS)}, not {level!r}")
    if fmt not in ("text", "json"):
        raise ValueError(f"--log-format must be text or json, not {fmt!r}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(level)
    handler.setFormatter(JsonFormatter() if fmt == "json" else
                         logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level)
    global _format
    _format = fmt
    logging.captureWarnings(True)  # warnings.warn through the handler, not a bare line on stderr
    if fmt == "json":
        sys.excepthook = _log_uncaught
        threading.excepthook = lambda a: _log_uncaught(a.exc_type, a.exc_value, a.exc_traceback)
    logging.getLogger("zoo_gym.server").setLevel(min(logging.INFO, logging.getLevelName(level)))
    quiet_libraries()


def announce(message: str, *, level: int = logging.INFO, **fields) -> None:
    """A line the operator always sees, whatever --log-level: plain text, or a JSON object with --log-format
    json (logger zoo_gym.server, `event` "lifecycle" unless given)."""
    if _format == "json":
        record = logging.LogRecord("zoo_gym.server", level, __file__, 0, message, None, None)
        record.__dict__.update({"event": "lifecycle", **fields})
        message = JsonFormatter().format(record)
    print(message, file=sys.stderr, flush=True)


def _log_uncaught(exc_type, exc, tb) -> None:
    if exc_type is not None and not issubclass(exc_type, SystemExit):
        logging.getLogger("zoo_gym.server").critical("uncaught %s", exc_type.__name__, exc_info=(exc_type, exc, tb))


def quiet_libraries() -> None:
    """No tqdm bars from model loading or downloads in a server's log."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except ImportError:
        pass
