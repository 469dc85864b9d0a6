"""``kvobs explain``: read vLLM logs people already have and say what their offload assertions mean.

Finds every offload assertion in every wording vLLM has used (``Block ...`` up to 0.28,
``Chunk ...`` since; ``not found in cache``, ``is not ready for reading``), decodes each key
(block-hash prefix, KV-cache group), reads kvobs's own explanation when the log already carries
it, and — given a kvobs directory or a sidecar URL — adds what kvobs recorded about that key:
its failure report and its last removals (kvobs/explain_evidence.py). Without kvobs data it says
what the log alone tells and what to enable next time.

Logs are read as they are shipped (``kvobs.logtext``: by content, whatever the file's name): UTF-8,
UTF-16 or UTF-32 (a byte-order mark, or UTF-16's NUL pattern), LF or CRLF, gzip, xz or bz2
compressed (rotated logs), every ECMA-48 escape sequence removed (colours, ``tput sgr0``, OSC), and
any JSON wrapping — vLLM's JSON log formatter, Docker's json-file lines, Loki or Elasticsearch
exports — whose string values are decoded (nested up to ``MAX_JSON_DEPTH``) before the assertion
is looked for, so the key reads the same whatever the escaping.

Pure text processing and file reading; never imports vLLM. Any input is accepted: undecodable
bytes are replaced, over-long lines cut, a damaged gzip stream ends the input with a note, and a
key that cannot be parsed is shown raw.
"""

from __future__ import annotations

import ast
import contextlib
import itertools
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, BinaryIO

from kvobs import explain_tracebacks, message
from kvobs.codes import CAUSES
from kvobs.keys import decode_key
from kvobs.logtext import UnreadableLog, log_lines, strip_escapes
from kvobs.wire.format import KEYS_LISTED, MAX_GROUP, key_ref, load_json, parse_integer

MAX_LINE_CHARS = 1 << 20
"""Longer log lines are cut (an assertion line is a few hundred characters; kvobs's own ~2 KiB)."""
MAX_ASSERTIONS = 1_000
"""Distinct assertions reported per run; further ones are counted."""
MAX_DROPPED_TRACKED = 1_000_000
"""Distinct assertions remembered beyond MAX_ASSERTIONS, so a repeat is not counted twice."""
MAX_JSON_DEPTH = 3
"""JSON inside JSON that is decoded (Docker's json-file line around vLLM's JSON formatter is 2)."""
REMOVALS_SHOWN = 3
"""An assertion's latest removals shown (kvobs/explain_evidence.py keeps no more)."""
MAX_PLAUSIBLE_GROUP = 1024
"""A key whose last 4 bytes read as a larger group index is a bare block hash (no group suffix)."""

_BYTES_LITERAL = r"b'(?:[^'\\]|\\.)*'|b\"(?:[^\"\\]|\\.)*\""
ASSERTION = re.compile(
    rf"(?P<noun>Block|Chunk) (?P<key>{_BYTES_LITERAL}|-?\d+|0x[0-9a-fA-F]+) "
    r"(?P<what>not found in (?:file )?cache|is not ready for reading)"
)
KVOBS_SUFFIX = message.SUFFIX_RE
"""kvobs's message right after vLLM's text: ``group``, ``req_id`` (compiled from ``kvobs.message``'s parts)."""
KVOBS_CAUSE = message.CAUSE_RE
"""kvobs's cause, searched for after the suffix, to the end of the line: ``cause``, ``evidence``, ``causes``."""
JSON_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
WORDING_HINTS = ("not found in", "not ready for reading")
ENGINE = re.compile(r"EngineCore(?:_DP|_)?(?P<dp>\d+)?\b")
LOG_TIME = re.compile(r"\b(?P<time>\d\d-\d\d \d\d:\d\d:\d\d)\b")

MEANING = {
    "evicted_after_lookup": "this request's lookup reported the chunk (HIT), then a capacity eviction removed it",
    "reset_after_lookup": "reported, then reset_cache() dropped it",
    "store_failed_after_lookup": "reported (HIT_PENDING), then its store failed and removed it",
    "coverage_mismatch": "this request's lookup never reported the chunk",
    "store_in_flight": "the chunk exists but its store has not completed",
    "unknown": "reported, but no removal recorded (older than the history, or an unobserved path)",
}
assert set(MEANING) == set(CAUSES)

ENABLE_HINT = (
    "Next time, run vLLM with kvobs so the assertion names its cause: "
    "--kv-transfer-config '{\"kv_connector\":\"OffloadingConnector\",\"kv_role\":\"kv_both\","
    "\"kv_connector_extra_config\":{\"spec_name\":\"ObservedOffloadingSpec\",\"spec_module_path\":\"kvobs.vllm\","
    "\"kvobs\":{\"inner_spec\":\"CPUOffloadingSpec\"}, ...}}' with KVOBS_DIR set, run `kvobs serve --dir "
    "$KVOBS_DIR`, and pass --dir to `kvobs explain`."
)


class ExplainError(Exception):
    """Bad input to ``kvobs explain`` (a file, directory or URL that cannot be read)."""


@dataclass
class LoggedAssertion:
    """One offload assertion found in a log, with what can be read from it alone."""

    line: int
    text: str
    noun: str
    state: str  # "missing" | "not_ready"
    what: str  # vLLM's words after the key
    key_text: str
    key: bytes | None
    engine: str | None = None
    log_time: str | None = None
    occurrences: int = 1
    kvobs_group: int | None = None
    kvobs_req_id: str | None = None
    kvobs_cause: str | None = None
    kvobs_evidence: str | None = None
    reports: list[dict[str, Any]] = field(default_factory=list)
    removals: list[dict[str, Any]] = field(default_factory=list)

    @property
    def key_ref(self) -> str | None:
        """The key as kvobs journals it: hash prefix / group."""
        if self.key is None or len(self.key) < 5:
            return None
        return key_ref(self.key)

    @property
    def vllm_text(self) -> str:
        return f"{self.noun} {self.key_text} {self.what}"


# -- reading logs ---------------------------------------------------------------------------


def _texts(line: str, replaced: list[int], depth: int = 0, hints: tuple[str, ...] = WORDING_HINTS,
           wanted: Callable[[str], Any] = ASSERTION.search) -> list[str]:
    """The texts of a line to search: the line itself, or — when it is JSON (a formatter, a log
    shipper, an export) — its decoded string values that hold an assertion (``wanted``), one per line of each.
    ``replaced[0]`` counts the strings whose text was not valid (load_json replaced it: a note says so)."""
    if depth >= MAX_JSON_DEPTH or '"' not in line or not any(hint in line for hint in hints):
        return [line]
    decoded: list[str] = []
    for token in JSON_STRING.finditer(line):
        if not any(hint in token[0] for hint in hints):
            continue
        try:
            value, invalid = load_json(token[0])  # a lone surrogate ("\udc80") is replaced: printable
        except (ValueError, RecursionError):
            continue
        replaced[0] += invalid
        if isinstance(value, str):  # decoded: the raw text would misread escaped keys
            for part in value.splitlines():
                decoded.extend(_texts(strip_escapes(part), replaced, depth + 1, hints, wanted))
    return decoded if any(wanted(text) for text in decoded) else [line]


def _parse_key(text: str) -> bytes | None:
    if not text.startswith(("b'", 'b"')):
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError, MemoryError, RecursionError):
        return None
    return value if isinstance(value, bytes) else None


def _parse_str(text: str) -> str | None:
    if text == "None":
        return None
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return None
    return value if isinstance(value, str) else None


@dataclass
class LogScan:
    """What one log holds: its distinct assertions, how many more were not kept, and damage."""

    assertions: list[LoggedAssertion]
    not_shown: int
    damage: list[str]
    exceptions: list[explain_tracebacks.LoggedException] = field(default_factory=list)
    """Exceptions that left vLLM's offloading code (kvobs.explain_tracebacks), besides prepare_load's."""
    exceptions_not_shown: int = 0


def scan_log(stream: BinaryIO) -> LogScan:
    """Distinct offload assertions in a log, however the log was shipped: distinct by wording, key and
    engine, and by the request and cause kvobs's message names (issue 31, class 6: two engines failing
    on one key, or two survived loads of one key in one engine, are different failures). A line
    without kvobs's message is counted with the first assertion of its key on its engine, a line of no
    engine (another process re-logging it) with the first of its key (and request and cause) on any."""
    index = _Found()
    dropped: set[tuple[Any, ...]] = set()
    untracked = 0
    damage: list[str] = []
    replaced = [0]
    tracebacks = explain_tracebacks.TracebackScanner(lambda text: ASSERTION.search(text) is not None, _where)
    decoded = log_lines(stream, damage, MAX_LINE_CHARS)
    with contextlib.closing(decoded):  # closed while ``stream`` is still open, however the scan ends
        try:
            lines = enumerate(decoded, start=1)
            first_line = next(lines, None)
        except UnreadableLog as exc:
            raise ExplainError(f"cannot read {getattr(stream, 'name', 'the log')}: {exc}") from None
        for number, line in itertools.chain(() if first_line is None else (first_line,), lines):
            for text in _texts(line, [0], hints=explain_tracebacks.HINTS, wanted=explain_tracebacks.WANTED):
                tracebacks.feed(number, text, line)
            for text in _texts(line, replaced):
                for match in ASSERTION.finditer(text):
                    state = "missing" if match["what"].startswith("not found") else "not_ready"
                    engine_match = ENGINE.search(text) or ENGINE.search(line)
                    engine = None if engine_match is None else (engine_match["dp"] or "0")  # vLLM's engine label
                    keyed = (match["noun"], match["key"], state)
                    told = _kvobs_told(text, match.end())
                    part = None if told is None else (told.req_id, told.cause)
                    known = index.find(keyed, engine, part)
                    if known is None and told is not None:
                        known = index.tell_untold(keyed, engine, told)
                    if known is not None:
                        known.occurrences += 1
                        continue
                    if len(index.entries) >= MAX_ASSERTIONS:
                        ident = (keyed, engine, part)
                        if ident in dropped:
                            continue
                        if len(dropped) < MAX_DROPPED_TRACKED:
                            dropped.add(ident)
                        else:
                            untracked += 1
                        continue
                    when = LOG_TIME.search(text) or LOG_TIME.search(line)
                    entry = LoggedAssertion(
                        line=number,
                        text=text.strip()[:2000],
                        noun=match["noun"],
                        state=state,
                        what=match["what"],
                        key_text=match["key"],
                        key=_parse_key(match["key"]),
                        engine=engine,
                        log_time=None if when is None else when["time"],
                    )
                    if told is not None:
                        _tell(entry, told)
                    index.add(entry, keyed, part)
    if replaced[0]:
        damage.append(f"{replaced[0]} JSON string(s) held text that is not valid (a lone surrogate), read with "
                      "U+FFFD in its place")
    entries = index.entries
    return LogScan(entries, len(dropped) + untracked, damage, tracebacks.entries, tracebacks.not_shown)


def _where(text: str, line: str) -> tuple[str | None, str | None]:
    """(engine, log time) of a text of a line, as an assertion's are read."""
    engine_match = ENGINE.search(text) or ENGINE.search(line)
    when = LOG_TIME.search(text) or LOG_TIME.search(line)
    return (None if engine_match is None else (engine_match["dp"] or "0"),
            None if when is None else when["time"])


class _Found:
    """The assertions found so far, by what tells them apart (:func:`scan_log`): ``keyed`` is (wording,
    key, state), ``part`` the (request, cause) kvobs's message names (None: the line has none). A line
    of no engine (no ``EngineCore`` prefix: another process re-logging it) joins the first assertion
    of its key and part on any engine."""

    def __init__(self) -> None:
        self.entries: list[LoggedAssertion] = []
        self._by_part: dict[tuple[Any, ...], LoggedAssertion] = {}  # (keyed, engine, part)
        self._first: dict[tuple[Any, ...], LoggedAssertion] = {}  # (keyed, engine): the key's first

    def find(self, keyed: tuple[str, str, str], engine: str | None, part: tuple[Any, ...] | None
             ) -> LoggedAssertion | None:
        if part is None:  # no kvobs message: counted with the first assertion of its key on its engine
            return self._first.get((keyed, engine))
        return self._by_part.get((keyed, engine, part))

    def tell_untold(self, keyed: tuple[str, str, str], engine: str | None, told: _Told) -> LoggedAssertion | None:
        """The assertion first logged without kvobs's message on this engine, now told by it (None if
        there is none still untold)."""
        untold = self._by_part.get((keyed, engine, None))
        if untold is None or untold.kvobs_cause is not None or untold.kvobs_req_id is not None:
            return None
        _tell(untold, told)
        for slot in ((keyed, engine, None), (keyed, untold.engine, None), (keyed, None, None)):
            if self._by_part.get(slot) is untold:
                del self._by_part[slot]
        self._register(untold, keyed, (told.req_id, told.cause))
        return untold

    def add(self, entry: LoggedAssertion, keyed: tuple[str, str, str], part: tuple[Any, ...] | None) -> None:
        self.entries.append(entry)
        self._register(entry, keyed, part)
        self._first.setdefault((keyed, entry.engine), entry)
        self._first.setdefault((keyed, None), entry)

    def _register(self, entry: LoggedAssertion, keyed: tuple[str, str, str], part: tuple[Any, ...] | None) -> None:
        self._by_part.setdefault((keyed, entry.engine, part), entry)
        self._by_part.setdefault((keyed, None, part), entry)


@dataclass(frozen=True)
class _Told:
    """What kvobs's message after vLLM's text says: the group, the request, the cause and its evidence."""

    group: int | None
    req_id: str | None
    cause: str | None
    evidence: str | None


def _kvobs_told(line: str, end: int) -> _Told | None:
    """kvobs's message right after vLLM's text on the same line, None when the line has none."""
    suffix = KVOBS_SUFFIX.match(line, end)
    if suffix is None:
        return None
    group = parse_integer(suffix["group"], 0, MAX_GROUP)  # None when "None" or out of range
    req_id = _parse_str(suffix["req_id"])
    cause = KVOBS_CAUSE.search(line, suffix.end())
    if cause is None or cause["cause"] not in MEANING:
        return _Told(group, req_id, None, None)
    return _Told(group, req_id, cause["cause"], cause["evidence"])


def _tell(entry: LoggedAssertion, told: _Told) -> None:
    entry.kvobs_group, entry.kvobs_req_id = told.group, told.req_id
    entry.kvobs_cause, entry.kvobs_evidence = told.cause, told.evidence


# -- saying it ---------------------------------------------------------------------------------


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


def located(entry: Any) -> dict[str, Any]:
    """Where a death is in the log, as ``--json`` says it (an assertion's entry or an exception's)."""
    return {"line": entry.line, "occurrences": entry.occurrences, "engine": entry.engine, "log_time": entry.log_time}


def heading(label: str, entry: Any) -> str:
    """``[label] line N, engine E, logged T, K times``: where a death is in the log (an assertion's entry or an
    exception's, kvobs/explain_tracebacks.py)."""
    where = [f"line {entry.line}"]
    if entry.engine:
        where.append(f"engine {entry.engine}")
    if entry.log_time:
        where.append(f"logged {entry.log_time}")
    if entry.occurrences > 1:
        where.append(f"{entry.occurrences} times")
    return f"\n[{label}] {', '.join(where)}"


def _utc(timestamp: Any) -> str:
    """A wall time for people; a damaged one (not a number, out of range) is said so, not raised."""
    if not _is_number(timestamp):
        return "time unknown"
    try:
        return datetime.fromtimestamp(timestamp, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    except (OverflowError, OSError, ValueError):
        return "time unknown"


def _key_line(entry: LoggedAssertion) -> str:
    key = entry.key
    if key is None:
        return f"key: {entry.key_text[:80]} (not a bytes key; shown as logged)"
    if len(key) < 5:
        return f"key: {key!r} ({len(key)} bytes, too short to hold a KV-cache group)"
    decoded = decode_key(key)
    if decoded.group >= MAX_PLAUSIBLE_GROUP:  # a bare block hash, as older vLLM versions keyed blocks
        return f"key: block hash {key[:8].hex()}… ({len(key)} bytes), no KV-cache group suffix"
    group = f"KV-cache group {decoded.group}"
    return f"key: block hash {decoded.hash_prefix}… ({len(decoded.block_hash)} bytes), {group}"


def _wording_line(entry: LoggedAssertion) -> str:
    era = "vLLM <= 0.28" if entry.noun == "Block" else "vLLM >= 0.29"
    if entry.state == "not_ready":
        return (f"wording: '{entry.noun} ... is not ready for reading' ({era}): the chunk is in the CPU tier but its "
                "store has not completed (cause store_in_flight: a load was prepared before the store finished)")
    return (f"wording: '{entry.noun} ... not found in cache' ({era}): the chunk was not in the CPU tier when "
            "prepare_load() pinned it")


def render(entries: list[LoggedAssertion], dropped: int, have_data: bool, source: str,
           damage: Iterable[str] = (), exceptions: list[explain_tracebacks.LoggedException] | None = None,
           exceptions_not_shown: int = 0) -> str:
    """The human-readable explanation of every assertion found, then of every other exception that left
    vLLM's offloading code (kvobs.explain_tracebacks)."""
    notes = "".join(f"note: {source}: {problem}\n" for problem in damage)
    others = explain_tracebacks.render(exceptions or [], exceptions_not_shown, have_data, source)
    if not entries and others:
        return notes + "\n".join(others) + "\n"
    if not entries:
        return notes + (f"no offload assertion found in {source} (looked for 'Block|Chunk <key> not found in "
                        "cache' and '... is not ready for reading')\n")
    out: list[str] = [f"{len(entries)} offload assertion{'s' * (len(entries) > 1)} in {source}"]
    for number, entry in enumerate(entries, start=1):
        out.append(heading(str(number), entry))
        out.append(f"  vLLM said: {entry.vllm_text[:300]}")
        out.append(f"  {_key_line(entry)}")
        out.append(f"  {_wording_line(entry)}")
        if entry.kvobs_cause:
            req = f", req_id {entry.kvobs_req_id!r}" if entry.kvobs_req_id else ""
            out.append(f"  kvobs (in the log): cause {entry.kvobs_cause}{req}: {MEANING[entry.kvobs_cause]}")
            out.append(f"    evidence: {entry.kvobs_evidence}")
        for report in entry.reports[:REMOVALS_SHOWN]:
            cause = report.get("cause")
            out.append(f"  kvobs failure report {report.get('id', '?')} (engine {report.get('engine')}, "
                       f"{_utc(report.get('time', 0))}): cause {cause}: {MEANING.get(str(cause), '?')}")
            listed = report.get("missing")
            for missing in listed[:4] if isinstance(listed, list) else ():
                if isinstance(missing, dict):
                    out.append(f"    key {missing.get('key')} end_token {missing.get('end_token')}: "
                               f"{missing.get('cause')} ({missing.get('evidence')})")
        for removal in entry.removals:
            residency = removal["residency_s"]
            resident = "" if residency is None else f", resident {residency:.3f}s"
            out.append(f"  removed {_utc(removal['time'])} on {removal['engine']}: {removal['reason']}, "
                       f"path={removal['path']}, req_id={removal['req_id']!r}{resident}")
        if have_data and not entry.reports and not entry.removals:
            out.append("  kvobs data: no record of this key (older than the journals kept, listed beyond the first "
                       f"{KEYS_LISTED} keys of a batch, or kvobs was not running on that engine)")
        if not have_data and not entry.kvobs_cause:
            if entry.state == "not_ready":
                out.append("  This log alone names the cause: store_in_flight.")
            else:
                out.append("  This log alone cannot tell a coverage mismatch (the lookup never reported the chunk) "
                           "from an eviction after the lookup.")
    if dropped:
        out.append(f"\n{dropped} more distinct assertions not shown (at most {MAX_ASSERTIONS})")
    if not have_data and not any(e.kvobs_cause for e in entries):
        out.append(f"\n{ENABLE_HINT}")
    if others:
        out.extend(["", *others])
    return notes + "\n".join(out) + "\n"


def as_json(entries: Iterable[LoggedAssertion]) -> list[dict[str, Any]]:
    """Machine-readable form (``kvobs explain --json``)."""
    return [
        {
            **located(e),
            "wording": e.noun,
            "state": e.state,
            "vllm_message": e.vllm_text,
            "key": e.key_ref,
            "kvobs_cause": e.kvobs_cause,
            "kvobs_req_id": e.kvobs_req_id,
            "reports": [r.get("id") for r in e.reports],
            "report_causes": [r.get("cause") for r in e.reports],
            "removals": e.removals,
        }
        for e in entries
    ]
