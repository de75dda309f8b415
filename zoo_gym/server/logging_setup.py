"""The server's log: one handler on stderr, as text or as one JSON object per line (`--log-format`).

Library chatter stays out: transformers' and huggingface_hub's progress bars ("Loading weights") are
switched off, their warnings go through this handler like everything else. The server's own logger
always produces its INFO records (the metrics time the publish phases from them); the handler's level
decides what is printed.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import datetime, timezone

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")


class JsonFormatter(logging.Formatter):
    """{"time", "level", "logger", "message", ...extra fields, "exception"} on one line."""

    def format(self, record: logging.LogRecord) -> str:
        doc = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        doc.update({k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")})
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


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
    logging.getLogger("zoo_gym.server").setLevel(min(logging.INFO, logging.getLevelName(level)))
    quiet_libraries()


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
