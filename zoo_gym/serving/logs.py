"""gym-serve's logging on stderr: ``text`` (``gym-serve: message``) or ``json`` (one JSON object per line
and nothing else: our records, uvicorn's error and access logs with their fields, transformers' and Python
warnings, uncaught exceptions with their traceback in ``exc``; never ANSI colour).
"""

from __future__ import annotations

import logging
import sys
import threading

from zoo_gym.log_format import JsonFormatter


def _json_formatter() -> JsonFormatter:
    """gym-serve's lines: lower-case levels, uvicorn's access fields, the traceback under "exc"."""
    return JsonFormatter(lower_level=True, extra_fields=False, access_fields=True, exception_key="exc")


def json_line(message: str, level: str = "error", logger: str = "zoo_gym.serving") -> str:
    """One record as a JSON line, for messages written before logging is set up."""
    return _json_formatter().format(logging.makeLogRecord({"name": logger, "levelname": level, "msg": message}))


def setup(fmt: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_json_formatter() if fmt == "json" else logging.Formatter("gym-serve: %(message)s"))
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
