"""How ``kvobs serve`` logs: plain text for a terminal, one JSON object a line for a log pipeline.

Collectors (Loki, Elasticsearch, Cloud Logging) parse JSON lines into fields without a custom
parser, so ``--log-format json`` makes the sidecar's warnings (an unreadable file, a checkpoint it
cannot trust) searchable by level and logger like the rest of a cluster's logs.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")
TEXT_FORMAT = "%(levelname)s %(name)s: %(message)s"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (RFC 3339, UTC), level, logger, message, and the traceback if any."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure(log_format: str = "text", level: str = "warning") -> None:
    """Route every logger to standard error in ``log_format`` at ``level`` (replacing earlier set-up)."""
    if log_format not in FORMATS or level not in LEVELS:
        raise ValueError(f"log format must be one of {FORMATS} and level one of {LEVELS}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
