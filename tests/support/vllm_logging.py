"""vLLM's logging configured as JSON lines (tests/integration/test_logs_through_vllm.py, tests/engine)."""

from __future__ import annotations

import json
from pathlib import Path


def json_logging_config(path: Path) -> Path:
    """A ``VLLM_LOGGING_CONFIG_PATH`` file: vLLM's logger as JSON lines (vLLM's documented form; also
    used by tests/engine/test_serve_more.py)."""
    path.write_text(json.dumps({
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"json": {"class": "pythonjsonlogger.jsonlogger.JsonFormatter",
                                "format": "%(asctime)s %(levelname)s %(name)s %(process)d %(message)s"}},
        "handlers": {"json": {"class": "logging.StreamHandler", "formatter": "json", "stream": "ext://sys.stdout"}},
        "loggers": {"vllm": {"handlers": ["json"], "level": "INFO", "propagate": False}},
    }))
    return path
