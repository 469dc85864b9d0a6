"""``kvobs explain``'s second finding: an exception that left vLLM's offloading code, read from the log.

Two forms are recognised, in the lines :func:`kvobs.explain.scan_log` reads (every encoding, compression,
escape and JSON wrapping it undoes):

- a Python traceback whose innermost frame inside the ``vllm`` package (``File ".../vllm/<path>.py", line N,
  in <function>``) lies in vLLM's offloading code (``OFFLOAD_CODE``), up to its exception line
  (``AssertionError``, ``AssertionError: msg``, ``KeyError: 'x'``, ``vllm.x.SomeError: msg``). Each line of it
  may carry the prefix its header line carries (vLLM's ``(EngineCore_DP0 pid=7) ERROR 12-06 10:00:00
  [core.py:1]``, a shipper's timestamp of the same shape) or none; lines of other processes in between are
  passed over. The expression is the source line Python printed under the frame (an ``assert``'s test when
  that line parses alone), nothing else is read;
- kvobs's own log line, ``kv offload exception at <file>:<line> in <function> (assert <expr>); ...``
  (kvobs.boundary.OffloadException.message): the site, the connector's method and side, the requests, the cause.

prepare_load's ``Chunk ... not found in cache`` is not one of these: :mod:`kvobs.explain` explains it (its
traceback is passed over here). Both forms of one death (kvobs's line, then vLLM's traceback) are one entry:
distinct by site (file, function, line), exception type and engine; a line of no engine joins the first of its
site on any engine. With ``--dir`` or ``--sidecar``, the failure reports of the same site are attached: their
cause, method and the requests involved with their lifecycle. Pure text processing: no vLLM import, no file read.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvobs.boundary import LOG_PREFIX, SURVIVED, THROUGH_CONNECTOR, THROUGH_MANAGER
from kvobs.sites import MAX_EXPRESSION

OFFLOAD_CODE = (
    "v1/kv_offload/",
    "distributed/kv_transfer/kv_connector/v1/offloading/",
    "distributed/kv_transfer/kv_connector/v1/offloading_connector.py",
)
"""vLLM's offloading code, as paths relative to the ``vllm`` package (as kvobs.sites names a site's file): the
manager package and the offloading connector (0.30.0 to 0.34.0 lay it out alike)."""
MAX_EXCEPTIONS = 1_000
"""Distinct exceptions reported per log; further ones are counted (as ``explain.MAX_ASSERTIONS``)."""
MAX_DROPPED_TRACKED = 100_000
MAX_FOREIGN_LINES = 64
"""Lines of other output passed over inside one traceback before it is given up as cut."""
MAX_SHAPED_PREFIX = 300
"""A longer prefix of a traceback's header is matched exactly only, not by its shape (digits as any digit)."""
MAX_FIELD = 500
MAX_MESSAGE = 300
MAX_KVOBS_LINE = 8_000
"""Characters of kvobs's line read after its site (its message is a few hundred; the request ids the rest)."""
REPORTS_SHOWN = 3
REQUESTS_SHOWN = 4
EVENTS_SHOWN = 8
HEADER = "Traceback (most recent call last):"
HINTS = (HEADER[:-1], LOG_PREFIX)
"""What a JSON string holding one of these has in it (``explain._texts`` decodes such strings)."""
WANTED = re.compile(re.escape(HEADER[:-1]) + "|" + re.escape(LOG_PREFIX) + " at ").search
FRAME = re.compile(r'^\s*File "(?P<path>[^"]{1,4096})", line (?P<line>\d{1,9}), in (?P<function>\S{1,200})\s*$')
EXCEPTION = re.compile(r"^(?P<type>(?:[A-Za-z_]\w*\.){0,20}[A-Za-z_]\w*)(?::(?: (?P<message>.*))?)?$")
EXCEPTION_NAME = re.compile(r"(?:Error|Exception|Exit|Interrupt|Warning|Failure|Fault|Iteration)$")
"""A bare name on a line of its own is the exception when it is named as one (else: a source line whose
indentation the log lost)."""
CARETS = re.compile(r"^\s*[\^~]+\s*$")
KVOBS_SITE = re.compile(re.escape(LOG_PREFIX)
                        + r" at (?P<file>[^\s:]{1,500}):(?P<line>\d{1,9}) in (?P<function>[^\s(;]{1,200})")
KVOBS_CALL = re.compile(r"(?P<side>\w{1,20})-side (?P<method>\w{1,100}); (?P<type>[\w.]{1,200}): ")
KVOBS_MANAGER_CALL = re.compile(r"(?P<method>\w{1,100}); (?P<type>[\w.]{1,200}): ")
KVOBS_TAIL = re.compile(r"; cause: (?P<cause>\w{1,40})(?:; vLLM (?P<vllm>[^\s;]{1,40}))?")
CONNECTOR_HINT = (
    "Next time, run vLLM with kvobs's connector so each exception is reported with the requests involved: "
    "--kv-transfer-config '{\"kv_connector\":\"ObservedOffloadingConnector\",\"kv_connector_module_path\":"
    "\"kvobs.vllm.connector\",\"kv_role\":\"kv_both\",\"kv_connector_extra_config\":{\"spec_name\":"
    "\"ObservedOffloadingSpec\",\"spec_module_path\":\"kvobs.vllm\",...}}' with KVOBS_DIR set, and pass --dir."
)


def offload_file(path: str) -> str | None:
    """The file relative to the ``vllm`` package when ``path`` (as a traceback prints it) is inside it, else
    None. kvobs's own ``kvobs/vllm/`` glue is not vLLM's."""
    path = path.replace("\\", "/")
    at = path.rfind("/vllm/")
    if at < 0 or path[:at].endswith("/kvobs") or path[:at] == "kvobs":
        return None
    return path[at + len("/vllm/"):]


def is_offload_code(file: str) -> bool:
    return file.startswith(OFFLOAD_CODE)


@dataclass
class LoggedException:
    """One exception that left vLLM's offloading code, as the log tells it."""

    line: int
    file: str
    """Relative to the ``vllm`` package."""
    function: str
    site_line: int
    exception_type: str | None
    message: str | None
    expression: str = ""
    statement: str = ""
    """``assert`` when the source line (or kvobs's line) says so, else ""."""
    engine: str | None = None
    log_time: str | None = None
    occurrences: int = 1
    seen_in: list[str] = field(default_factory=list)
    """``traceback`` and/or ``kvobs_log``."""
    kvobs: dict[str, Any] | None = None
    """What kvobs's line says: side, method, cause, req_ids, vllm."""
    reports: list[dict[str, Any]] = field(default_factory=list)

    @property
    def type_name(self) -> str | None:
        return None if self.exception_type is None else self.exception_type.rsplit(".", 1)[-1]

    @property
    def site(self) -> tuple[str, str, int]:
        return (self.file, self.function, self.site_line)


@dataclass
class _Open:
    """A traceback being read."""

    number: int
    prefix: str
    shape: str
    header: str
    line: str
    frames: int = 0
    inner: list[Any] = field(default_factory=list)  # [file, function, line, source] of the innermost vLLM frame
    last_is_inner: bool = False
    after_frame: bool = False
    foreign: int = 0


def _shape(text: str) -> str:
    return re.sub(r"\d", "0", text)


def _source(text: str) -> tuple[str, str]:
    """(expression, statement) of the source line a traceback printed: an assert's test when the line parses
    alone (parsed, never evaluated), else the line as printed."""
    text = text.strip()
    statement = "assert" if re.match(r"assert\b", text) else ""
    if statement and len(text) <= MAX_EXPRESSION:
        try:
            tree = ast.parse(text)
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            tree = None
        if tree is not None and len(tree.body) == 1 and isinstance(tree.body[0], ast.Assert):
            return (ast.get_source_segment(text, tree.body[0].test) or text)[:MAX_EXPRESSION], statement
    return text[:MAX_EXPRESSION], statement


class TracebackScanner:
    """Fed every text of a log in order (:func:`kvobs.explain.scan_log`); keeps the distinct exceptions.

    ``explained(text)``: the exception line is one :mod:`kvobs.explain` explains itself (prepare_load's chunk);
    ``where(text, line)``: (engine, log time) of a line, as explain reads them."""

    def __init__(self, explained: Callable[[str], bool],
                 where: Callable[[str, str], tuple[str | None, str | None]]) -> None:
        self.entries: list[LoggedException] = []
        self.not_shown = 0
        self._explained = explained
        self._where = where
        self._open: _Open | None = None
        self._index: dict[tuple[Any, ...], LoggedException] = {}
        self._dropped: set[tuple[Any, ...]] = set()

    def feed(self, number: int, text: str, line: str) -> None:
        kvobs_at = text.find(LOG_PREFIX)
        told = kvobs_at >= 0 and self._kvobs_line(number, text, line, kvobs_at)
        header_at = text.find(HEADER)
        if header_at >= 0:
            prefix = text[:header_at]
            self._open = _Open(number, prefix, _shape(prefix[:MAX_SHAPED_PREFIX]), text, line)
            return
        current = self._open
        if current is None or told:
            return
        if text.startswith(current.prefix) or (
                len(current.prefix) <= MAX_SHAPED_PREFIX and _shape(text[:len(current.prefix)]) == current.shape):
            body = text[len(current.prefix):]
        else:
            body = text  # a line the process wrote without the prefix (or a shipper dropped it)
        self._body(current, body.rstrip("\r"))

    def _body(self, current: _Open, body: str) -> None:
        frame = FRAME.match(body)
        if frame is not None:
            current.frames += 1
            file = offload_file(frame["path"])
            current.last_is_inner = file is not None
            if file is not None:
                current.inner = [file[:MAX_FIELD], frame["function"], int(frame["line"]), None]
            current.after_frame = True
            return
        if not body.strip() or CARETS.match(body) or body.lstrip().startswith("[Previous line repeated"):
            return
        indented = body[:1].isspace()
        exception = None if indented else EXCEPTION.match(body)
        if current.after_frame:  # the frame's source line, unless the exception (no source available)
            current.after_frame = False
            if exception is None or not (exception["message"] is not None or EXCEPTION_NAME.search(exception["type"])):
                if current.last_is_inner and current.inner[3] is None:
                    current.inner[3] = body  # lost indentation too: a bare name is a source line
                return
        if indented:
            return  # more of a multi-line source (3.13), a chained exception's or a group's lines
        if exception is not None and current.frames:
            self._open = None
            self._died(current, exception["type"], exception["message"], body)
            return
        current.foreign += 1
        if current.foreign > MAX_FOREIGN_LINES:
            self._open = None

    def _died(self, current: _Open, exc_type: str, message: str | None, body: str) -> None:
        if not current.inner or not is_offload_code(current.inner[0]) or self._explained(body):
            return
        file, function, site_line, source = current.inner
        expression, statement = ("", "") if source is None else _source(source)
        engine, when = self._where(current.header, current.line)
        entry = LoggedException(current.number, file, function, site_line, exc_type[:MAX_FIELD],
                                None if message is None else message[:MAX_MESSAGE], expression, statement,
                                engine, when)
        self._add(entry, "traceback")

    def _kvobs_line(self, number: int, text: str, line: str, at: int) -> bool:
        """kvobs's line at ``at``, if it is one with a site (not "at outside vLLM's package")."""
        site = KVOBS_SITE.match(text, at)
        if site is None:
            return False
        rest = text[site.end():site.end() + MAX_KVOBS_LINE]
        through, marker = rest.find(f"; {THROUGH_CONNECTOR}"), THROUGH_CONNECTOR
        if through < 0:
            through, marker = rest.find(f"; {THROUGH_MANAGER}"), THROUGH_MANAGER
        expression = statement = ""
        told: dict[str, Any] = {}
        exc_type = message = None
        if through >= 0:
            said = rest[:through]
            raised = said.rfind("; raised at ")
            if raised >= 0:
                told["raised_at"] = said[raised + len("; raised at "):][:MAX_FIELD]
                said = said[:raised]
            if said.startswith(" (") and said.endswith(")"):
                expression = said[2:-1]
                if expression.startswith("assert "):
                    expression, statement = expression[len("assert "):], "assert"
            call = (KVOBS_CALL if marker == THROUGH_CONNECTOR else KVOBS_MANAGER_CALL).match(
                rest, through + 2 + len(marker))
            if call is not None:
                exc_type = call["type"]
                told.update(side=call.groupdict().get("side") or "manager", method=call["method"])
                after = rest[call.end():]
                cut = after.rfind("; requests: ")
                message = after[:cut if cut >= 0 else len(after)][:MAX_MESSAGE] or None
                if cut >= 0:
                    tail = after[cut + len("; requests: "):]
                    cause_at = tail.rfind("; cause: ")
                    told["req_ids"] = _req_ids(tail[:cause_at] if cause_at >= 0 else "")
                    cause = KVOBS_TAIL.match(tail, cause_at) if cause_at >= 0 else None
                    if cause is not None:
                        told["cause"], told["vllm"] = cause["cause"], cause["vllm"]
                        told["recomputed"] = tail.rstrip().endswith(f"; {SURVIVED}")
        engine, when = self._where(text, line)
        entry = LoggedException(number, site["file"], site["function"], int(site["line"]), exc_type, message,
                                expression[:MAX_EXPRESSION], statement, engine, when, kvobs=told)
        self._add(entry, "kvobs_log")
        return True

    def _add(self, entry: LoggedException, seen: str) -> None:
        key = (entry.site, entry.type_name)
        known = self._index.get((*key, entry.engine))
        if known is None and entry.engine is None:
            known = self._index.get((*key, "*"))
        if known is not None:
            if seen in known.seen_in:
                known.occurrences += 1
            else:
                known.seen_in.append(seen)
            _merge(known, entry)
            return
        if len(self.entries) >= MAX_EXCEPTIONS:
            ident = (*key, entry.engine)
            if ident not in self._dropped:
                self.not_shown += 1
                if len(self._dropped) < MAX_DROPPED_TRACKED:
                    self._dropped.add(ident)
            return
        entry.seen_in.append(seen)
        self.entries.append(entry)
        self._index.setdefault((*key, entry.engine), entry)
        self._index.setdefault((*key, "*"), entry)


def _merge(known: LoggedException, entry: LoggedException) -> None:
    """kvobs's line names the whole expression and the call; the traceback, vLLM's full exception type."""
    if entry.kvobs and not known.kvobs:
        known.kvobs = entry.kvobs
        if entry.expression:
            known.expression, known.statement = entry.expression, entry.statement
    if not known.expression and entry.expression:
        known.expression, known.statement = entry.expression, entry.statement
    if entry.exception_type and (known.exception_type is None or "." in entry.exception_type):
        known.exception_type = entry.exception_type
    if known.message is None:
        known.message = entry.message
    if known.engine is None:
        known.engine = entry.engine


def _req_ids(text: str) -> list[str]:
    if not text.startswith("[") or len(text) > MAX_KVOBS_LINE:
        return []
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        return []
    return [v[:200] for v in value if isinstance(v, str)][:16] if isinstance(value, list) else []


# -- what kvobs recorded --------------------------------------------------------------------


def report_matches(report: dict[str, Any], entry: LoggedException) -> bool:
    """A failure report of the same site (file, function, line), and of the same exception type when both say."""
    site = report.get("site")
    if not isinstance(site, dict) or (site.get("file"), site.get("function"), site.get("line")) != entry.site:
        return False
    reported = report.get("exception_type")
    return not (isinstance(reported, str) and entry.type_name and reported.rsplit(".", 1)[-1] != entry.type_name)


def attach(reports: Iterable[Any], entries: list[LoggedException]) -> None:
    """Each report to the exceptions of its site (at most ``REPORTS_SHOWN`` an exception are kept)."""
    if not entries:
        return
    for report in reports:
        if isinstance(report, dict) and isinstance(report.get("site"), dict):
            for entry in entries:
                if len(entry.reports) < REPORTS_SHOWN and report_matches(report, entry) and report not in entry.reports:
                    entry.reports.append(report)


# -- saying it ---------------------------------------------------------------------------------


def _text(value: Any, room: int = 200) -> str:
    return str(value)[:room]


def _story(request: Any) -> str:
    """One request's lifecycle in a line: its events, oldest first, each with what it said."""
    if not isinstance(request, dict):
        return "?"
    events = request.get("events")
    if not request.get("recorded") or not isinstance(events, list) or not events:
        return f"{_text(request.get('req_id'), 100)!s}: not recorded (arrived before the connector's ring starts)"
    told = []
    for event in events[:EVENTS_SHOWN]:
        if isinstance(event, dict):
            detail = _text(event.get("detail") or "", 80)
            told.append(f"{_text(event.get('method'), 60)}{f' ({detail})' if detail else ''}")
    more = len(events) - EVENTS_SHOWN + (request.get("events_not_kept") or 0 if isinstance(
        request.get("events_not_kept"), int) else 0)
    return f"{_text(request.get('req_id'), 100)}: {' -> '.join(told)}{f' (+{more} more)' if more > 0 else ''}"


def _site_text(entry: LoggedException) -> str:
    said = ""
    if entry.expression:
        said = f" ({'assert ' if entry.statement == 'assert' else ''}{entry.expression[:300]})"
    return f"{entry.file}:{entry.site_line} in {entry.function}{said}"


def render(entries: list[LoggedException], not_shown: int, have_data: bool, source: str) -> list[str]:
    """Lines of the text output (:func:`kvobs.explain.render` joins them after its assertions)."""
    from kvobs.explain import _utc, heading

    if not entries:
        return []
    out = [f"{len(entries)} offload exception{'s' * (len(entries) > 1)} in {source} (an exception left vLLM's "
           "offloading code)"]
    for number, entry in enumerate(entries, start=1):
        out.append(heading(f"E{number}", entry))
        out.append(f"  site: {_site_text(entry)}")
        said = entry.exception_type or "(exception type not in the log)"
        if entry.message:
            said += f": {entry.message[:300]}"
        out.append(f"  exception: {said}")
        seen = ("vLLM traceback" if s == "traceback" else "kvobs log line" for s in entry.seen_in)
        out.append(f"  seen in: {', '.join(seen)}")
        told = entry.kvobs or {}
        if told.get("method"):
            through = (f"{THROUGH_MANAGER}{told['method']}" if told.get("side") == "manager"
                       else f"{THROUGH_CONNECTOR}{told.get('side')}-side {told['method']}")
            out.append(f"  kvobs (in the log): {through}, "
                       f"cause {told.get('cause')}, requests {told.get('req_ids', [])!r}"[:600])
            if told.get("raised_at"):
                out.append(f"    raised at {told['raised_at']} (outside vLLM's package)")
            if told.get("recomputed"):
                out.append("    survived: kvobs survive answered vLLM in its place (no hit: vLLM computed the prefix); "
                           "the engine went on")
        for report in entry.reports[:REPORTS_SHOWN]:
            requests = report.get("requests")
            req_ids = report.get("req_ids")
            out.append(f"  kvobs failure report {_text(report.get('id', '?'), 100)} "
                       f"(engine {_text(report.get('engine'), 40)}, "
                       f"{_utc(report.get('time', 0))}): cause {_text(report.get('cause'), 40)}, "
                       f"through {_text(report.get('side'), 20)}-side {_text(report.get('method'), 60)}, "
                       f"requests {[_text(r, 100) for r in req_ids[:8]] if isinstance(req_ids, list) else []!r}")
            for request in requests[:REQUESTS_SHOWN] if isinstance(requests, list) else ():
                out.append(f"    {_story(request)}"[:800])
        if have_data and not entry.reports:
            out.append("  kvobs data: no failure report of this site (kvobs's connector was not running on that "
                       "engine, or the report is not in the directory given)")
    if not_shown:
        out.append(f"\n{not_shown} more distinct exceptions not shown (at most {MAX_EXCEPTIONS})")
    if not have_data and not any("kvobs_log" in e.seen_in for e in entries):
        out.append(f"\n{CONNECTOR_HINT}")
    return out


def as_json(entries: Iterable[LoggedException]) -> list[dict[str, Any]]:
    """Machine-readable form (``kvobs explain --json``'s ``exceptions``)."""
    from kvobs.explain import located

    return [
        {
            **located(e),
            "site": {"file": e.file, "function": e.function, "line": e.site_line, "expression": e.expression,
                     "statement": e.statement},
            "exception_type": e.exception_type,
            "message": e.message,
            "seen_in": list(e.seen_in),
            "kvobs": e.kvobs,
            "reports": [r.get("id") for r in e.reports],
            "report_causes": [r.get("cause") for r in e.reports],
            "report_methods": [r.get("method") for r in e.reports],
            "report_requests": [_requests_json(r.get("requests")) for r in e.reports],
        }
        for e in entries
    ]


def _requests_json(requests: Any) -> list[dict[str, Any]]:
    out = []
    for request in requests[:REQUESTS_SHOWN] if isinstance(requests, list) else ():
        if isinstance(request, dict):
            events = request.get("events")
            out.append({"req_id": request.get("req_id"), "recorded": request.get("recorded"),
                        "events": [e.get("method") for e in events if isinstance(e, dict)]
                        if isinstance(events, list) else []})
    return out

