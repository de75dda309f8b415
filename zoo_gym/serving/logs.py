"""gym-serve's logging on stderr: ``text`` (``gym-serve: message``) or ``json`` (one JSON object per line
and nothing else: our records, uvicorn's error and access logs with their fields, transformers' and Python
warnings, uncaught exceptions with their traceback in ``exc``; never ANSI colour).
"""

from __future__ import annotations

import json
import logging
import sys
import threading
from datetime import datetime, timezone

_ACCESS_FIELDS = ("client", "method", "path", "http_version", "status")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
               "level": record.levelname.lower(), "logger": record.name, "message": record.getMessage()}
        if record.name == "uvicorn.access" and isinstance(record.args, tuple) and len(record.args) == 5:
            out.update(zip(_ACCESS_FIELDS, record.args))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def json_line(message: str, level: str = "error", logger: str = "zoo_gym.serving") -> str:
    """One record as a JSON line, for messages written before logging is set up."""
    now = datetime.now(timezone.utc).isoformat(timespec="milliseconds")
    return json.dumps({"time": now, "level": level, "logger": logger, "message": message})


def setup(fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter("gym-serve: %(message)s"))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # no "Loading weights" bar in the server's log
    hf_logging.set_verbosity_error()
    if fmt != "json":
        return
    hf_logging.disable_default_handler()  # its records reach the JSON handler instead
    hf_logging.enable_propagation()
    logging.captureWarnings(True)
    log = logging.getLogger("zoo_gym.serving")
    sys.excepthook = lambda *exc: log.critical("uncaught exception", exc_info=exc)
    threading.excepthook = lambda a: log.critical("uncaught exception in thread %s", getattr(a.thread, "name", "?"),
                                                  exc_info=(a.exc_type, a.exc_value, a.exc_traceback))
