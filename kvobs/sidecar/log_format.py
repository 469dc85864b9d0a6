"""How ``kvobs serve`` logs: plain text for a terminal, one JSON object a line for a log pipeline.

Collectors (Loki, Elasticsearch, Cloud Logging) parse JSON lines into fields without a custom
parser, so ``--log-format json`` makes the sidecar's warnings (an unreadable file, a checkpoint it
cannot trust) searchable by level and logger like the rest of a cluster's logs.

Each failure report the sidecar ingests is logged once as a structured line (:class:`FailureLines`):
JSON in either format, because its point is to outlive the pod in a log store (a report lives in the
pod's directory and dies with an emptyDir). Its fields are listed in README ("The sidecar").
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvobs import __version__
from kvobs.sidecar.query import report_path
from kvobs.wire.decode import Report
from kvobs.wire.format import fit_req_id

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")
TEXT_FORMAT = "%(levelname)s %(name)s: %(message)s"
FAILURE_EVENT = "kvobs.load_failure"
"""The ``event`` of the line logged for each failure report."""
SUPPRESSED_EVENT = "kvobs.load_failures_suppressed"
"""The ``event`` of the line that says how many failure lines the bound left out."""
FAILURE_LINES_BURST = 100
"""Failure lines logged at once; then :data:`FAILURE_LINES_PER_S`. A flood of reports (a replay of a
full directory, survive mode recomputing every request) cannot flood the log store."""
FAILURE_LINES_PER_S = 1.0
MAX_LOGGED_CAUSES = 16
"""Causes a line lists at most (a report's are validated label values, but not few)."""


def rfc3339(unix_s: float) -> str:
    """``unix_s`` as RFC 3339 in UTC with milliseconds (``2026-01-31T12:00:00.123Z``)."""
    ms = round(unix_s * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms // 1000)) + f".{ms % 1000:03d}Z"


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (RFC 3339, UTC), level, logger, message, the traceback if
    any, and a record's structured ``fields`` (:class:`FailureLines`) at the top level."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": rfc3339(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            entry.update((k, v) for k, v in fields.items() if k not in entry)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``TEXT_FORMAT``, except a record with structured ``fields``: that one is a JSON line as
    :class:`JsonFormatter` writes it, so a log pipeline parses it whatever ``--log-format`` says."""

    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)
        self._json = JsonFormatter()

    def format(self, record: logging.LogRecord) -> str:
        if isinstance(getattr(record, "fields", None), dict):
            return self._json.format(record)
        return super().format(record)


def configure(log_format: str = "text", level: str = "warning") -> None:
    """Route every logger to standard error in ``log_format`` at ``level`` (replacing earlier set-up)."""
    if log_format not in FORMATS or level not in LEVELS:
        raise ValueError(f"log format must be one of {FORMATS} and level one of {LEVELS}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


def failure_fields(report: Report) -> dict[str, Any]:
    """The structured facts of one failure report, as its log line carries them (README, "The sidecar")."""
    data = report.data
    causes: Counter[str] = Counter()
    for cause, _group, n in report.summary.counts:  # validated by the decoder, unlike data["causes"]
        if cause in causes or len(causes) < MAX_LOGGED_CAUSES:
            causes[cause] += n
    req_id = data.get("req_id")
    missing = data.get("num_missing")  # validated as a count when present (kvobs.wire.decode)
    return {
        "event": FAILURE_EVENT,
        "failure_time": rfc3339(report.time),
        "failure_time_unix": report.time,
        "cause": report.cause,
        "causes": dict(causes),
        "engine": report.engine,
        "model_name": report.model_name,
        "request_id": fit_req_id(req_id) if isinstance(req_id, str) else None,
        "report_id": report.name,
        "report_path": report_path(report.name),
        "missing_keys": int(missing) if missing is not None else sum(causes.values()),
        "load_keys": int(data["num_keys"]) if "num_keys" in data else None,
        "recomputed": data.get("recomputed") is True,
        "trace_id": report.trace_id,
        "span_id": data.get("span_id"),  # validated with trace_id
        "kvobs_version": __version__,
    }


class FailureLines:
    """One line per failure report ingested, bounded: a token bucket of :data:`FAILURE_LINES_BURST`
    lines refilled at :data:`FAILURE_LINES_PER_S`. A line the bound leaves out is counted; the next
    line logged says how many were left out before it (``suppressed``), and if no report comes,
    :meth:`write` logs a line of its own once the bucket allows.

    :meth:`take` runs under the ingest lock and only decides; :meth:`write` logs outside it, so a
    slow log pipe never holds up a scrape. What waits between them is bounded by the burst."""

    def __init__(self, logger: logging.Logger, burst: int = FAILURE_LINES_BURST,
                 per_s: float = FAILURE_LINES_PER_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.burst, self.per_s, self.clock = burst, per_s, clock
        self._tokens = float(burst)
        self._refilled = clock()
        self._pending: list[dict[str, Any]] = []
        self.suppressed = 0
        """Lines left out since the last line taken."""
        self.suppressed_total = 0

    def _token(self) -> bool:
        now = self.clock()
        self._tokens = min(float(self.burst), self._tokens + (now - self._refilled) * self.per_s)
        self._refilled = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True

    def take(self, report: Report) -> bool:
        """Keep ``report``'s line for :meth:`write`, or count it as left out (False)."""
        if not self._token():
            self.suppressed += 1
            self.suppressed_total += 1
            return False
        self._pending.append(failure_fields(report) | {"suppressed": self.suppressed})
        self.suppressed = 0
        return True

    def write(self) -> None:
        """Log the lines taken; then, if lines were left out and no line taken since has said so, a line
        that says how many (once the bucket allows)."""
        pending, self._pending = self._pending, []
        for fields in pending:
            self.logger.warning("kvobs sidecar: load failure of engine %s (model %r): %s, request %s, report %s",
                                fields["engine"], fields["model_name"], fields["cause"], fields["request_id"],
                                fields["report_path"], extra={"fields": fields})
        if self.suppressed and self._token():
            self.logger.warning(
                "kvobs sidecar: %d failure lines left out (at most %d at once, then %g a second); every report "
                "is in /api/v1/failures", self.suppressed, self.burst, self.per_s,
                extra={"fields": {"event": SUPPRESSED_EVENT, "suppressed": self.suppressed,
                                  "kvobs_version": __version__}})
            self.suppressed = 0
