"""The engine -> sidecar wire format, defined once: record kinds and their fields, versions, limits,
the checks every field read back passes, key refs and file names (built and parsed).

Journal: JSON lines, one record a line (a partial last line is left for later, so a crash
mid-append loses nothing already complete), in ``<dir>/journal/<stem>.<seq>.jsonl`` where the stem
is ``<engine>-<pid>`` (``<engine>-<pid>_<n>`` for the n-th other writer of the engine in one
process). Kinds (the ``k`` field; the order of a line's keys carries no meaning):

* ``hello``: a writer started (versions, options, which hot path runs, whether it observes);
* ``totals``: cumulative counters of one writer (``pid`` + ``run``), so a reader is exact
  even when other records were dropped, and never double counts;
* ``removals``: a run of removal batches as little-endian binary columns in base64 (batch
  times, flags, key counts, the requests as a JSON list, and per listed key an 8-byte hash
  prefix, its 4-byte group and its residency as float32, NaN where unknown); at most
  ``KEYS_LISTED`` keys are listed per batch, and ``ages`` lines carry the rest of a huge
  batch's residencies;
* ``near_miss`` and ``failure``: notes kvobs 0.1.0 wrote (nothing read them; read and passed over).

Failure reports: one JSON file each in ``<dir>/failures/``, named by :func:`report_name`.

Writers: :mod:`kvobs.wire.encode`; readers: :mod:`kvobs.wire.decode`. Pure: stdlib only.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import logging
import re
from collections.abc import Collection, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

from kvobs.metric_catalogue import COUNTED, TOTALS

if TYPE_CHECKING:
    from typing_extensions import TypeIs

FORMAT_VERSION = 2
MAX_LINE_BYTES = 8 * 2**20
"""Far above any line kvobs writes: a longer one is skipped as corrupt, not waited on."""
MAX_REPORT_BYTES = 4 * 2**20
MAX_REPORT_KEYS = 1_000
"""Keys a failure report details (~350 bytes each); its ``missing_summary`` counts every key."""
KEYS_LISTED = 4_096
"""Keys a removals line names per batch (for ``kvobs explain``); the rest are counted."""
AGES_PER_LINE = 65_536
KEY_REF_BYTES = 12
"""A listed key: the first 8 bytes of its block hash and its 4-byte group."""
MAX_BATCHES_PER_LINE = 65_536
MAX_COUNT = 2**53
"""The largest count a record may carry (a float64 holds integers exactly up to here)."""
MAX_SECONDS = 1e10
"""A time or age beyond this (about 317 years) is not one kvobs wrote."""
MAX_GROUP = 2**32 - 1
"""The largest KV-cache group index: a key's last 4 bytes hold it (:func:`key_ref_bytes`)."""

# -- the text limits writer and reader share (one definition each; the writer fits to them) --

MAX_LABEL = 256
"""A short text field of a ``hello`` (versions, the hot path's name)."""
MAX_SHORT_LABEL = 64
"""A writer's ``run`` and a counter's label (a totals record's map keys, and the checkpoint's)."""
MAX_MODEL_NAME = 4096
"""A ``model_name`` label: PATH_MAX, so any model path vLLM takes as its served name fits whole and
kvobs's label still joins vLLM's (the ``model_name`` option has the same limit, kvobs.options)."""
MAX_REQ_ID = 4096
"""A request id in a removals line or a report: clients choose them, so longer ones are fitted."""
MAX_DETAIL = 500
"""Why an engine runs unobserved (a ``hello``'s ``detail``)."""
MAX_ENGINE_LABEL = 64
ENGINE_LABEL = re.compile(rf"[A-Za-z0-9][A-Za-z0-9_.:-]{{0,{MAX_ENGINE_LABEL - 1}}}")
"""An ``engine`` label (:func:`is_engine_label`): it names the engine's journal files and reports, so it
must be a safe file name."""
ENGINE_LABEL_RULE = (f"1-{MAX_ENGINE_LABEL} letters, digits, '_', '.', ':' or '-', starting with a letter "
                     "or digit")
""":data:`ENGINE_LABEL` in words, for the errors of the option check and the API."""
REPORT_ID = re.compile(rf"\d{{15}}-(?P<engine>{ENGINE_LABEL.pattern})-\d{{1,10}}-\d{{1,10}}")
"""A failure report's id, the stem of its file name (:func:`report_name`); ids sort in the order
reports were written (by time, unless the clock stepped back)."""

JOURNAL_DIR = "journal"
FAILURES_DIR = "failures"
JOURNAL_SUFFIX = ".jsonl"
REPORT_SUFFIX = ".json"

KINDS = ("hello", "totals", "removals", "ages", "near_miss", "failure")
"""The journal's record kinds (a line's ``k``). A reader skips a line of another kind (a newer writer's),
counting it as unknown, not as corrupt."""
NOTE_KINDS = ("near_miss", "failure")
HEAD_FIELDS = ("k", "e", "pid", "run", "m")
"""The fields every journal line starts with: kind, engine label, pid, writer run, model_name (if known)."""
TOTAL_KEYS: tuple[str, ...] = tuple(TOTALS)
"""The counter maps of a ``totals`` line: kvobs/metric_catalogue.py's totals keys."""
TOTAL_LABELS: dict[str, tuple[str, ...]] = TOTALS
"""The label values each totals map starts with (its metric's ``values``, or its counters' parts)."""
JOINED_LABELS: dict[str, str] = {m.totals: m.sep for m in COUNTED if m.sep}
"""Totals maps whose keys join two label values (``MetricDef.sep``): only the first is checked against the
known values; the second (``kvobs_offload_exceptions``'s site) is open, bounded by :func:`kept_labels`."""
EXTENSION = "ext"
"""A ``totals`` line's map of counts under label values the readers of format 2 as of kvobs 0.1.0
refuse (:data:`FROZEN_READER_LABELS`): ``{totals key: {label value: count}}``. Those readers ignore a
field they do not know, so they keep reading every other count; today's readers add it in."""
FROZEN_READER_LABELS: dict[str, frozenset[str]] = {
    "evicted": frozenset(("capacity", "store_failed", "reset", "deferred_release")),
    "batches": frozenset(("capacity", "store_failed", "reset", "deferred_release")),
    "near": frozenset(("capacity", "store_failed", "reset", "deferred_release")),
    "failures": frozenset(("evicted_after_lookup", "reset_after_lookup", "store_failed_after_lookup",
                           "coverage_mismatch", "store_in_flight", "unknown")),
    "errors": frozenset(("record.removal", "record.lookup", "record.load", "record.finish", "record.schedule_end",
                         "diagnosis", "verdicts", "journal", "report", "tracing", "sink", "shutdown", "hook",
                         "survive")),
    "dropped": frozenset(("journal", "verdicts", "ingest")),
    "survive": frozenset(("loads", "tokens", "alarms")),
}
"""History, not a list to keep in step: the label values kvobs 0.1.0's reader accepts in each totals map
(it refuses a whole line over any other). Frozen for good: a writer puts every other value under
:data:`EXTENSION` (docs/design.md, "Wire compatibility"; tests/unit/test_wire_compat.py)."""
MAX_LABEL_VALUES = 64
"""Label values beyond the known ones a reader keeps per label (of a totals map, a line's and an
engine's; of every other label the sidecar exports: causes from reports, groups, residency reasons); the
rest are summed under :data:`OTHER` (:func:`kept_labels` says which), so no writer or report can grow a
sidecar's series without bound."""
OTHER = "other"
MAX_ENGINES = 256
"""Engines (``model_name``, ``engine`` pairs) a sidecar keeps series of: one sidecar serves one node's DP
ranks, a few dozen at most. Any engine first met beyond them is summed under ``model_name`` and ``engine``
both :data:`OTHER` (kvobs.sidecar.state.SidecarState.engine), so no directory can grow its series without
bound."""
RECORD_FIELDS: dict[str, tuple[str, ...]] = {
    "hello": (*HEAD_FIELDS, "t", "format", "version", "vllm_version", "history_size", "hot_path", "observing",
              "reason", "detail"),
    "totals": (*HEAD_FIELDS, "t", "q", *TOTAL_KEYS, EXTENSION, "hist_keys", "hist_window"),
    "removals": (*HEAD_FIELDS, "s", "n", "to", "t", "f", "c", "l", "req", "keys", "ages"),
    "ages": (*HEAD_FIELDS, "r", "ages"),
}
"""The fields of each kind this reader knows (notes carry free fields). A reader keeps a line with
others (a newer writer's), counting each unknown field once (docs/design.md, "Wire compatibility")."""


OBSERVING_REASONS = ("ok", "unsupported_vllm", "error")
"""The ``reason`` label of ``kvobs_observing``: observing, or why kvobs stepped aside."""



# -- file names, built and parsed ------------------------------------------------------------


def report_name(wall_time: float, engine: str, pid: int, n: int, after_ms: int = -1, suffix: str = ".json") -> str:
    """The file name of a failure report (or, with its ``suffix``, of a replay bundle: kvobs/bundles.py): its
    millisecond wall time first, so names sort by time; or ``after_ms + 1`` (``after_ms``: the newest
    report's time in the directory) when the wall time is not later, the clock having been stepped back:
    names then still sort in the order the reports were written, and pruning by name drops the oldest, not
    the one being written (issue 31, class 2). Its stem matches :data:`REPORT_ID`."""
    return f"{max(int(wall_time * 1000), after_ms + 1):015d}-{engine}-{pid}-{n}{suffix}"



_TIMED_NAME = re.compile(r"(\d{15})-")


def report_time_ms(report_id: str) -> int | None:
    """The millisecond wall time a report's id (its file name's stem) starts with, None if it has none."""
    timed = _TIMED_NAME.match(report_id)
    return int(timed.group(1)) if timed else None


def report_engine(report_id: str) -> str | None:
    """The engine a report's id (its file name's stem) names, None if it is no :data:`REPORT_ID`."""
    named = REPORT_ID.fullmatch(report_id)
    return named.group("engine") if named else None


def journal_stem(engine: str, pid: int, n: int = 0) -> str:
    """The stem of a writer's journal files: ``<engine>-<pid>``, ``<engine>-<pid>_<n>`` for the n-th
    other writer of the same engine in the same process and directory."""
    return f"{engine}-{pid}" if n == 0 else f"{engine}-{pid}_{n}"


def journal_name(stem: str, seq: int) -> str:
    """The file name of a writer's ``seq``-th journal segment."""
    return f"{stem}.{seq:06d}{JOURNAL_SUFFIX}"


def stem_of(name: str) -> str:
    """``<engine>-<pid>[_<n>]`` of ``<stem>.<seq>.jsonl``."""
    return name[: -len(JOURNAL_SUFFIX)].rpartition(".")[0]


def parse_stem(stem: str) -> tuple[str, int] | None:
    """(engine, pid) of a journal file stem, None if its pid part is not ``<pid>`` or ``<pid>_<n>``."""
    engine, _, stem_pid = stem.rpartition("-")
    pid = stem_pid.partition("_")[0]
    return (engine, int(pid)) if pid.isdigit() else None


# -- key refs ---------------------------------------------------------------------------------


def key_ref_bytes(key: bytes) -> bytes:
    """A key as listed in removals lines: 8 bytes of block hash (zero-padded), 4 bytes of group."""
    return key[:-4][:8].ljust(8, b"\0") + key[-4:].rjust(4, b"\0")


def key_ref(key: bytes) -> str:
    """A key as reports and ``kvobs explain`` name it: its 8-byte hash prefix in hex, then its group."""
    return ref_text(key_ref_bytes(key))


def ref_text(ref: bytes) -> str:
    """A listed key (``KEY_REF_BYTES``) as text: ``<16 hex digits>/<group>``."""
    return f"{ref[:8].hex()}/{int.from_bytes(ref[8:], 'big')}"



def ref_group(ref: bytes) -> int:
    """The KV-cache group of a listed key (its last 4 bytes)."""
    return int.from_bytes(ref[8:KEY_REF_BYTES], "big")


def ref_groups(refs: bytes) -> Iterator[int]:
    """The group of each listed key in a removals line's ``keys`` column."""
    return (int.from_bytes(refs[i + 8 : i + KEY_REF_BYTES], "big") for i in range(0, len(refs), KEY_REF_BYTES))


def ref_from_text(ref: str) -> bytes | None:
    """:func:`ref_text` back to the bytes a removals line lists (None if it is not one)."""
    prefix, _, group_text = ref.partition("/")
    group = parse_integer(group_text, 0, MAX_GROUP)
    try:
        raw = bytes.fromhex(prefix)
    except ValueError:
        return None
    return raw + group.to_bytes(4, "big") if len(raw) == 8 and group is not None else None


# -- validation ---------------------------------------------------------------------------


def is_number(value: Any, low: float, high: float, *, integer: bool = False) -> TypeIs[int | float]:
    """The one check every number read from disk or a request passes before any arithmetic.

    Never raises: JSON integers are unbounded, and ``math.isfinite`` or ``float()`` of one no
    float holds raises ``OverflowError``; comparing an ``int`` with a float bound is exact and
    cannot overflow, so the range is checked before anything converts the value.
    """
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if isinstance(value, float) and (value != value or (integer and not value.is_integer())):
        return False  # NaN, or a float that is not a whole number where one is needed
    return low <= value <= high  # also refuses ±inf


_INTEGER_TEXT = re.compile(r"-?[0-9]{1,20}")


def parse_integer(text: str, low: int, high: int) -> int | None:
    """A decimal integer written as text (a log line, a query), None unless it is one in [low, high].

    Its digits are counted before ``int()`` reads them: ``int()`` of a text of over 4,300 digits
    raises ``ValueError``, and of fewer still costs time quadratic in its length.
    """
    if not _INTEGER_TEXT.fullmatch(text):
        return None
    value = int(text)
    return value if is_number(value, low, high, integer=True) else None


def is_count(value: Any) -> TypeIs[int | float]:
    """A non-negative integer (JSON may write it as 3 or 3.0) within float64's exact range."""
    return is_number(value, 0, MAX_COUNT, integer=True)


def is_seconds(value: Any, *, signed: bool = False) -> TypeIs[int | float]:
    """A finite number of seconds within ``MAX_SECONDS`` (non-negative unless ``signed``)."""
    return is_number(value, -MAX_SECONDS if signed else 0.0, MAX_SECONDS)


def is_label(value: Any, max_len: int = MAX_LABEL) -> TypeIs[str]:
    return isinstance(value, str) and 0 < len(value) <= max_len


def is_engine_label(value: Any) -> TypeIs[str]:
    """An ``engine`` label as kvobs writes it: the one check of the option, the reader and the API."""
    return isinstance(value, str) and ENGINE_LABEL.fullmatch(value) is not None


def is_model_name(value: Any) -> TypeIs[str]:
    """A ``model_name`` label value as kvobs writes it ("" when not known)."""
    return isinstance(value, str) and len(value) <= MAX_MODEL_NAME and value.isprintable()


_fitted: set[str] = set()  # the fields whose fitting was logged (once each)


def fit_text(value: str, limit: int, what: str, *, printable: bool = False) -> str:
    """``value`` as a writer may write it: unchanged when its reader takes it, else fitted.

    Fitted: (where ``printable`` is asked) characters that are not become ``?``, and a text over ``limit`` keeps its
    first characters and ends with ``~`` and 16 hex digits of its sha256, so two long values
    stay apart. Said once per ``what`` in the log. Readers fit what an older writer wrote the
    same way, so a value is never why a record is refused.
    """
    if len(value) <= limit and (not printable or value.isprintable()):
        return value
    fitted = "".join(c if c.isprintable() else "?" for c in value) if printable else value
    if len(fitted) > limit:
        digest = hashlib.sha256(value.encode("utf-8", "surrogatepass")).hexdigest()[:16]
        fitted = fitted[: max(0, limit - 17)] + "~" + digest
    if what not in _fitted:
        _fitted.add(what)
        logging.getLogger("kvobs").warning(
            "kvobs: a %s of %d characters does not fit the journal's limit (%d characters%s); "
            "written as %r (cut, with a hash of the whole; said once)", what, len(value), limit,
            ", printable" if printable else "", fitted[:80])
    return fitted


def fit_model_name(value: str) -> str:
    """The ``model_name`` label as journals and reports carry it (:func:`fit_text`)."""
    return fit_text(value, MAX_MODEL_NAME, "model_name", printable=True)


def fit_req_id(value: str | None) -> str | None:
    """A request id as removals lines and reports carry it (:func:`fit_text`)."""
    return value if value is None else fit_text(value, MAX_REQ_ID, "request id")


def kept_labels(values: Iterable[str], known: Collection[str]) -> set[str]:
    """The values of one label that are their own series; any other is summed under :data:`OTHER`.

    The one bound of every label kvobs exports (docs/design.md, "Label bounds"): every ``known`` value and
    ``OTHER`` are kept, and of the other ``values`` the :data:`MAX_LABEL_VALUES` first in code point order.
    Decided by the set of values alone, never by the order of a map's keys, of lines or of reports: the
    same data gives the same series to every reader, and bounding a part then the whole (a line, then an
    engine's sum of lines) keeps what bounding the whole keeps. A value that sorts after the bound moves to
    ``OTHER`` when earlier ones arrive (its series stops; ``OTHER`` takes its count).
    """
    others = {value for value in values if value not in known and value != OTHER}
    if len(others) > MAX_LABEL_VALUES:
        others = set(heapq.nsmallest(MAX_LABEL_VALUES, others))
    return {*known, OTHER, *others}


def bounded_counts(counts: Mapping[str, float], known: Collection[str]) -> dict[str, float]:
    """``counts`` with the values :func:`kept_labels` does not keep summed under :data:`OTHER`."""
    kept = kept_labels(counts, known)
    out: dict[str, float] = {}
    for label, count in counts.items():
        key = label if label in kept else OTHER
        out[key] = out.get(key, 0.0) + count
    return out


def add_counts(into: dict[str, float], known: Collection[str], counts: Mapping[str, float]) -> None:
    """Add ``counts`` into one counter map (of a line, or an engine's sum), bounded by :func:`kept_labels`
    (``known``: the map's pre-initialised values), so a writer cannot grow a reader's series without bound."""
    merged = dict(into)
    for label, count in counts.items():
        merged[label] = merged.get(label, 0.0) + count
    into.clear()
    into.update(bounded_counts(merged, known))


def counter_map(value: Any, known: Collection[str] = ()) -> dict[str, float] | None:
    """A ``{label: count}`` map of a totals record, or None if an entry is not a short label and a count.

    Label values it does not know are kept (a newer engine's; the caller tells them apart), bounded by
    :func:`kept_labels` with the map's ``known`` values, so a known value never lands in :data:`OTHER`.
    """
    if not isinstance(value, dict):
        return None
    if not all(is_label(label, MAX_SHORT_LABEL) and is_count(count) for label, count in value.items()):
        return None
    return bounded_counts({label: float(count) for label, count in value.items()}, known)


# -- text: what JSON can hold that no UTF-8 encodes ------------------------------------------------

LONE_SURROGATE = re.compile("[\ud800-\udfff]")
"""A surrogate code point in a decoded ``str``: JSON's ``"\\udc80"`` decodes to one (a pair decodes to
its character), and no UTF-8 encodes it, so a label value, a response or a log line holding one fails."""
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
REPLACEMENT = "\ufffd"


def valid_text(value: str) -> str:
    """``value`` with each lone surrogate replaced by U+FFFD: text every sink (UTF-8) takes."""
    return LONE_SURROGATE.sub(REPLACEMENT, value)


def _valid(value: Any, replaced: list[int]) -> Any:
    if isinstance(value, str):
        if LONE_SURROGATE.search(value) is None:
            return value
        replaced[0] += 1
        return valid_text(value)
    if isinstance(value, list):
        return [_valid(item, replaced) for item in value]
    if isinstance(value, dict):
        return {_valid(key, replaced): _valid(item, replaced) for key, item in value.items()}
    return value


def load_json(raw: bytes | str) -> tuple[Any, int]:
    """``json.loads(raw)`` with every string (keys too) made :func:`valid_text`, and how many were not.

    The one way kvobs's readers parse what they did not write themselves (journal lines, reports, the
    checkpoint, a sidecar's answer, JSON in a log): a lone surrogate is replaced where it is and counted by
    the caller, never the reason a scrape, a response or a log line fails later. ValueError and
    RecursionError as ``json.loads`` raises them. Cheap for what holds none: bytes whose text has no
    ``\\uD8..``-``\\uDF..`` escape are not walked (UTF-8 itself cannot carry a surrogate).
    """
    data = json.loads(raw)
    if isinstance(raw, bytes):
        if _SURROGATE_ESCAPE.search(raw) is None:
            return data, 0
    elif LONE_SURROGATE.search(raw) is None and _SURROGATE_ESCAPE.search(raw.encode("utf-8", "replace")) is None:
        return data, 0
    replaced = [0]
    return _valid(data, replaced), replaced[0]


def is_hex_id(value: Any, digits: int) -> TypeIs[str]:
    """A W3C trace (32 digits) or span (16 digits) id as kvobs writes it: lowercase hex, not all zero."""
    return (isinstance(value, str) and len(value) == digits and value.strip("0123456789abcdef") == ""
            and value.strip("0") != "")


# -- journal records, as read back ------------------------------------------------------------


class Writer(NamedTuple):
    """Who wrote a journal record: the engine label, the process, the writer's run id, and the
    served model (the ``model_name`` label; "" when not known)."""

    engine: str
    pid: int
    run: str
    model_name: str = ""

    @property
    def identity(self) -> tuple[str, str]:
        """(model_name, engine): the labels every series of this engine carries, as vLLM's do."""
        return self.model_name, self.engine


class Hello(NamedTuple):
    writer: Writer
    time: float
    version: str
    vllm_version: str
    history_size: int
    hot_path: str
    observing: bool
    reason: str  # why not, when not observing (kvobs.wire.OBSERVING_REASONS)
    detail: str = ""
    unknown: tuple[str, ...] = ()
    """What of the line this reader does not know (:func:`unknown_item`), kept or skipped, never refused."""
    invalid: int = 0
    """Strings of the line that were not valid text, replaced (:func:`load_json`); the sidecar counts them."""


class Totals(NamedTuple):
    writer: Writer
    time: float
    counters: dict[str, dict[str, float]]  # by TOTAL_KEYS: evicted, batches, near, failures, errors, dropped, survive
    history_keys: float
    history_window_s: float
    seq: int = 0
    """The writer's sequence number of this totals line (0 from writers before it had one): a reader
    keeps the highest, so a line read late (another file, a backlog) never replaces a newer one."""
    unknown: tuple[str, ...] = ()
    invalid: int = 0

    def newer_than(self, other: Totals) -> bool:
        """Whether these totals were written after ``other`` (same writer): by sequence, then time."""
        return (self.seq, self.time) >= (other.seq, other.time)


class Removals(NamedTuple):
    """A run of removal batches (``times`` are wall-clock seconds)."""

    writer: Writer
    first_serial: int
    times: list[float]
    reasons: list[str]
    paths: list[str]
    counts: list[int]
    reqs: list[str | None]
    listed: list[int]
    keys: bytes  # KEY_REF_BYTES per listed key
    ages: list[float]  # per listed key; NaN where unknown
    unknown: tuple[str, ...] = ()
    invalid: int = 0

    def batches(self) -> Iterator[tuple[int, float, str, str, str | None, int, list[bytes], list[float]]]:
        """(serial, time, reason, path, req_id, keys removed, listed key refs, their ages) per batch."""
        at = 0
        for i, listed in enumerate(self.listed):
            refs = [self.keys[(at + j) * KEY_REF_BYTES : (at + j + 1) * KEY_REF_BYTES] for j in range(listed)]
            yield (self.first_serial + i, self.times[i], self.reasons[i], self.paths[i], self.reqs[i],
                   self.counts[i], refs, self.ages[at : at + listed])
            at += listed


class Ages(NamedTuple):
    """More residencies of a batch too large to list whole."""

    writer: Writer
    reason: str
    ages: list[float]
    unknown: tuple[str, ...] = ()
    invalid: int = 0


class Note(NamedTuple):
    """A near miss or a failure, as the journal notes it (the counters travel in totals)."""

    writer: Writer
    kind: str
    time: float
    fields: dict[str, Any]
    unknown: tuple[str, ...] = ()
    invalid: int = 0


class Unknown(NamedTuple):
    """A line of a kind this reader does not know (a newer writer's): skipped, and counted as such."""

    writer: Writer
    kind: str
    unknown: tuple[str, ...] = ()
    invalid: int = 0


def unknown_item(what: str, name: str) -> str:
    """How a reader names what it does not know: ``<what>:<name>`` (``what`` in
    kvobs.metric_catalogue.UNKNOWN_WIRE; ``name`` fitted to a short label)."""
    return f"{what}:{fit_text(name, MAX_SHORT_LABEL, 'unknown wire item')}"


Record = Hello | Totals | Removals | Ages | Note | Unknown
