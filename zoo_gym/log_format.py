"""One log record as one JSON object on one line: the formatter gym-server and gym-serve both use.

Every line has "time" (UTC, milliseconds), "level", "logger" and "message". What else, and how, each
program chooses when it builds the formatter, so each writes what it always wrote. gym-server (the
defaults): levels upper case, a record's extra fields, the traceback under "exception". gym-serve:
levels lower case, uvicorn's access-log fields (client, method, path, http_version, status), the
traceback under "exc". uvicorn's ANSI `color_message` is never written.
"""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone

_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "color_message"}  # uvicorn's ANSI
ACCESS_FIELDS = ("client", "method", "path", "http_version", "status")  # uvicorn.access's five args


class JsonFormatter(logging.Formatter):
    """{"time", "level", "logger", "message", ...the fields chosen, exception_key} on one line."""

    def __init__(self, *, lower_level: bool = False, extra_fields: bool = True, access_fields: bool = False,
                 exception_key: str = "exception") -> None:
        super().__init__()
        self.lower_level, self.extra_fields, self.access_fields = lower_level, extra_fields, access_fields
        self.exception_key = exception_key

    def format(self, record: logging.LogRecord) -> str:
        doc = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
               "level": record.levelname.lower() if self.lower_level else record.levelname,
               "logger": record.name, "message": record.getMessage()}
        if self.extra_fields:
            doc.update({k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")})
        if (self.access_fields and record.name == "uvicorn.access" and isinstance(record.args, tuple)
                and len(record.args) == len(ACCESS_FIELDS)):
            doc.update(zip(ACCESS_FIELDS, record.args))
        if record.exc_info:
            doc[self.exception_key] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)
