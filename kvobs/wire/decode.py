"""Every reader of the wire: journal lines and files, failure reports and their directory.

Used alike by the sidecar (``kvobs.sidecar``: ingest, and its checkpoint reader for the fields a
checkpoint shares with the journal), by ``kvobs explain`` and by tests. Everything read from disk
is validated here, field by field (the checks are :mod:`kvobs.wire.format`'s): a line or a report
that does not fit (wrong type, non-finite or out-of-range number, inconsistent columns) is ``None``
to its reader, which skips and counts it; nothing malformed reaches a metric, a checkpoint or a
response. A line is read by its fields, never by the order of its keys.

What a newer writer may add is not damage: a label value, a totals map, a field or a record kind
this reader does not know is kept where it can be (label values: as their own series) and named in
the record's ``unknown`` (docs/design.md, "Wire compatibility"); the rest of the line is read.

Pure: stdlib only (the sidecar must load neither numpy nor vLLM; a test checks the modules a fresh
import loads).
"""

from __future__ import annotations

import base64
import binascii
import os
import stat
import sys
from array import array
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from kvobs.codes import CAUSES, EXCEPTION_CAUSES, PATHS, REASONS, unpack_flags
from kvobs.wire.format import (
    EXTENSION,
    HEAD_FIELDS,
    JOINED_LABELS,
    KEY_REF_BYTES,
    KINDS,
    MAX_BATCHES_PER_LINE,
    MAX_DETAIL,
    MAX_LABEL,
    MAX_LINE_BYTES,
    MAX_REPORT_BYTES,
    MAX_REQ_ID,
    MAX_SECONDS,
    MAX_SHORT_LABEL,
    OBSERVING_REASONS,
    OTHER,
    RECORD_FIELDS,
    REPORT_ID,
    REPORT_SUFFIX,
    TOTAL_LABELS,
    Ages,
    Hello,
    Note,
    Record,
    Removals,
    Totals,
    Unknown,
    Writer,
    add_counts,
    counter_map,
    fit_model_name,
    fit_req_id,
    fit_text,
    is_count,
    is_engine_label,
    is_hex_id,
    is_label,
    is_seconds,
    load_json,
    unknown_item,
)
from kvobs.wire.histogram import Histogram

_LITTLE = sys.byteorder == "little"


# -- columns ------------------------------------------------------------------------------


def _column(value: Any, typecode: str) -> array | None:
    """A base64 little-endian column as an array, or None if it is not one."""
    if not isinstance(value, str):
        return None
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        return None
    out = array(typecode)
    if len(raw) % out.itemsize:
        return None
    out.frombytes(raw)
    if not _LITTLE:
        out.byteswap()
    return out


# -- fields a journal line and the sidecar's checkpoint share ---------------------------------


def decode_writer(engine: Any, pid: Any, run: Any, model: Any = "") -> Writer | None:
    """Who wrote a record (``run`` None: a writer before runs), or None if a field does not fit."""
    if not is_engine_label(engine) or not is_count(pid) or not (run is None or is_label(run, MAX_SHORT_LABEL)):
        return None
    if not isinstance(model, str):
        return None
    return Writer(engine, int(pid), run or "", fit_model_name(model))


def decode_hello(writer: Writer, time: Any, fields: Mapping[str, Any]) -> Hello | None:
    """A ``hello`` from its fields (``version``, ``vllm_version``, ``hot_path``, ``history_size``,
    ``observing``, ``reason``, ``detail``; absent ones take their defaults), or None."""
    if not is_seconds(time):
        return None
    texts = {k: fields.get(k, "") for k in ("version", "vllm_version", "hot_path")}
    size, observing = fields.get("history_size", 0), fields.get("observing", True)
    reason, detail = fields.get("reason", "ok"), fields.get("detail", "")
    if not all(isinstance(v, str) for v in texts.values()) or not is_count(size):
        return None
    if not isinstance(observing, bool) or not is_label(reason, MAX_SHORT_LABEL) or not isinstance(detail, str):
        return None
    unknown = () if reason in OBSERVING_REASONS else (unknown_item("label_value", f"observing={reason}"),)
    texts = {k: fit_text(v, MAX_LABEL, k) for k, v in texts.items()}
    return Hello(writer, float(time), texts["version"], texts["vllm_version"], int(size), texts["hot_path"],
                 observing, reason, detail[:MAX_DETAIL], unknown)


def decode_counters(name: str, value: Any) -> dict[str, float] | None:
    """One of a totals record's counter maps (``name`` in ``TOTAL_KEYS``), or None if it does not fit."""
    return counter_map(value, TOTAL_LABELS[name]) if name in TOTAL_LABELS else None


def unknown_labels(counters: Mapping[str, Mapping[str, float]]) -> list[str]:
    """The label values of ``counters`` (totals maps) this reader does not know, as unknown items."""
    return [unknown_item("label_value", f"{name}={label}") for name, counts in counters.items()
            for label in counts if _first(name, label) not in TOTAL_LABELS.get(name, ())]


def _first(name: str, label: str) -> str:
    """A totals map's key as far as this reader checks it: the first value of a joined key (JOINED_LABELS)."""
    sep = JOINED_LABELS.get(name)
    return label.partition(sep)[0] if sep else label


def _unknown_fields(kind: str, record: Mapping[str, Any]) -> list[str]:
    known = RECORD_FIELDS[kind]
    return [unknown_item("field", f"{kind}.{field}") for field in record if field not in known]


# -- journal records ----------------------------------------------------------------------


def _decode_totals(writer: Writer, time: float, record: Mapping[str, Any]) -> Totals | None:
    """A ``totals`` line: every counter map this reader knows, plus the writer's :data:`EXTENSION`
    (counts under label values older readers refuse); maps it does not know are named unknown."""
    counters: dict[str, dict[str, float]] = {}
    unknown: list[str] = []
    extension = record.get(EXTENSION, {})
    if not isinstance(extension, dict):
        return None
    known_maps = [(name, value) for name, value in record.items() if name in TOTAL_LABELS]
    for name, value in known_maps + list(extension.items()):  # the line's maps, then its extension's
        counts = counter_map(value, TOTAL_LABELS.get(name, ()))
        if counts is None:
            return None
        if name not in TOTAL_LABELS:
            unknown.append(unknown_item("counter", name))
            continue
        add_counts(counters.setdefault(name, {}), TOTAL_LABELS[name], counts)
    keys, window, seq = record.get("hist_keys", 0), record.get("hist_window", 0.0), record.get("q", 0)
    if not is_count(keys) or not is_seconds(window) or not is_count(seq):
        return None
    unknown += unknown_labels(counters)
    for name in record:
        if name not in RECORD_FIELDS["totals"]:  # a map: a counter a newer writer added
            unknown.append(unknown_item("counter" if isinstance(record[name], dict) else "field", name))
    return Totals(writer, time, counters, float(keys), float(window), int(seq), tuple(dict.fromkeys(unknown)))


def decode_record(record: Any) -> Record | None:
    """A parsed journal line as its typed record, or None if any field does not fit."""
    if not isinstance(record, dict):
        return None
    writer = decode_writer(record.get("e"), record.get("pid"), record.get("run"), record.get("m", ""))
    if writer is None:
        return None
    kind = record.get("k")
    if kind == "removals":
        return _decode_removals(writer, record)
    if kind == "ages":
        ages, reason = _column(record.get("ages"), "f"), record.get("r")
        if ages is None or not is_label(reason, MAX_SHORT_LABEL) or not all(_age_ok(a) for a in ages):
            return None
        unknown = _unknown_fields("ages", record)
        if reason not in REASONS:
            unknown.append(unknown_item("label_value", f"reason={reason}"))
        return Ages(writer, reason, ages.tolist(), tuple(unknown))
    if kind not in KINDS:
        if not is_label(kind, MAX_SHORT_LABEL):
            return None
        return Unknown(writer, kind, (unknown_item("record_kind", kind),))
    time = record.get("t")
    if not is_seconds(time):
        return None
    if kind == "totals":
        return _decode_totals(writer, float(time), record)
    if kind == "hello":
        hello = decode_hello(writer, time, record)
        fields = _unknown_fields("hello", record)
        return hello if hello is None or not fields else hello._replace(unknown=(*hello.unknown, *fields))
    return Note(writer, kind, float(time), {k: v for k, v in record.items() if k not in HEAD_FIELDS})


def decode_line(line: bytes) -> Record | None:
    """One journal line (without its newline) as its record, or None if it is not one kvobs wrote.
    A string that is not valid text is replaced, and the record's ``invalid`` counts it (load_json)."""
    if len(line) >= MAX_LINE_BYTES:
        return None
    try:
        parsed, invalid = load_json(line)
    except (ValueError, RecursionError):
        return None
    record = decode_record(parsed)
    return record._replace(invalid=invalid) if record is not None and invalid else record


def _age_ok(age: float) -> bool:
    return age != age or 0.0 <= age <= MAX_SECONDS  # NaN: unknown


def _decode_removals(writer: Writer, record: dict[str, Any]) -> Removals | None:
    n, first, offset = record.get("n"), record.get("s"), record.get("to")
    if not is_count(n) or n > MAX_BATCHES_PER_LINE or not is_count(first) or not is_seconds(offset, signed=True):
        return None
    n = int(n)
    times, flags = _column(record.get("t"), "d"), _column(record.get("f"), "B")
    counts, listed = _column(record.get("c"), "I"), _column(record.get("l"), "I")
    reqs, ages = record.get("req"), _column(record.get("ages"), "f")
    refs = record.get("keys")
    if times is None or flags is None or counts is None or listed is None or ages is None:
        return None
    if not (len(times) == len(flags) == len(counts) == len(listed) == n):
        return None
    if not isinstance(reqs, list) or len(reqs) != n:
        return None
    if not all(r is None or isinstance(r, str) for r in reqs):
        return None
    if any(r is not None and len(r) > MAX_REQ_ID for r in reqs):  # an older writer's: fitted, not refused
        reqs = [fit_req_id(r) for r in reqs]
    if any(shown > count for shown, count in zip(listed, counts, strict=True)) or len(ages) != sum(listed):
        return None
    try:
        key_bytes = base64.b64decode(refs, validate=True) if isinstance(refs, str) else None
    except (binascii.Error, ValueError):
        key_bytes = None
    if key_bytes is None or len(key_bytes) != KEY_REF_BYTES * len(ages):
        return None
    wall = [t + float(offset) for t in times]
    if not all(is_seconds(t) for t in wall) or not all(_age_ok(a) for a in ages):
        return None
    reasons, paths = [], []
    unknown = _unknown_fields("removals", record)
    for packed in flags:
        reason, path = unpack_flags(packed)
        if reason >= len(REASONS):  # every code of the flags' reason bits is one: a bit flip, not a newer writer
            return None
        reasons.append(REASONS[reason])
        if path >= len(PATHS):  # a path a newer writer added: its batch is read, under "other"
            unknown.append(unknown_item("label_value", f"path={path}"))
        paths.append(PATHS[path] if path < len(PATHS) else OTHER)
    return Removals(writer, int(first), wall, reasons, paths, counts.tolist(), reqs, listed.tolist(), key_bytes,
                    ages.tolist(), tuple(dict.fromkeys(unknown)))


# -- reading journal files ----------------------------------------------------------------


MAX_RUNS_PER_FILE = 16
"""Writers whose removal serials a position remembers (:attr:`JournalPosition.serials`): a file holds one
writer's lines, or a few when a restarted container's engine reuses a dead one's pid and file."""


@dataclass
class JournalPosition:
    """How far a reader got in one journal file, and whether it is inside a line it skips."""

    offset: int = 0
    skipping: bool = False
    rewound: bool = False
    """Set when the file was found cut back under this position (copy-truncate rotation, an operator's
    ``truncate``): it is read again from its start. Left for the caller to clear."""
    serials: dict[str, int] = field(default_factory=dict)
    """Writer run -> the serial after the last removal batch this file gave: a file cut back to a size
    other than 0 is read again from its start, and the batches it gave before are not given again
    (their residency samples would count twice; totals are kept by their own sequence)."""
    repeated: bool = False
    """The last removals line was one already given: the ``ages`` lines that follow it are too."""
    identity: tuple[int, int] | None = None
    """(st_dev, st_ino) the file must have (None: any): a path renamed and replaced between the
    reader's listing and its open is not read under another file's position."""


def _cut_back(f: Any, position: JournalPosition) -> bool:
    """Whether the file shrank or was rewritten under ``position`` since it was read: shorter than the
    offset, or (outside a skipped line) the byte before the offset is no longer the end of a line.
    A reader that trusted the old offset would never read the writer's later lines (issue 31, class 4)."""
    if os.fstat(f.fileno()).st_size < position.offset:
        return True
    if position.skipping:
        return False  # inside a line it skips: no line end to check
    f.seek(position.offset - 1)
    return bool(f.read(1) != b"\n")


def read_new_records(path: Path, position: JournalPosition, max_bytes: int = 8 * 2**20) -> Iterator[Record | None]:
    """Complete records appended since ``position`` (None for each corrupt one); advances it.

    A partial last line (the writer is mid-append, or died mid-append) is left for the next
    call. A line of ``MAX_LINE_BYTES`` or more is no record kvobs writes: it is skipped (one
    None, however many reads it spans) rather than waited on forever. Opens with O_NOFOLLOW:
    a symlink is not a journal. A file cut back under ``position`` (:func:`_cut_back`; kvobs's own
    writer never cuts below a whole line) is read again from its start, and ``position.rewound`` says so.
    """
    with _open_regular(path) as f:
        st = os.fstat(f.fileno())
        if position.identity is not None and (st.st_dev, st.st_ino) != position.identity:
            raise FileNotFoundError(f"{path}: renamed and replaced since it was listed")
        if position.offset > 0 and _cut_back(f, position):
            position.offset, position.skipping, position.rewound = 0, False, True
        f.seek(position.offset)
        data = f.read(max_bytes)
    end = data.rfind(b"\n")
    if end < 0:
        if len(data) >= MAX_LINE_BYTES or (position.skipping and data):
            position.offset += len(data)
            if not position.skipping:
                position.skipping = True
                yield None
        return
    position.offset += end + 1
    lines = data[: end + 1].split(b"\n")
    if position.skipping:  # the rest of a line already counted
        lines = lines[1:]
        position.skipping = False
    for line in lines:
        if not line.strip():
            continue
        record = decode_line(line)  # None for a line of MAX_LINE_BYTES or more, too
        if not _given_before(record, position):
            yield record


def _given_before(record: Record | None, position: JournalPosition) -> bool:
    """Whether ``record`` is a removals line (or an ``ages`` line of one) this file already gave, by the
    writer's batch serials: they rise in the order a writer writes, so a line read again after a cut back
    to a size other than 0 is known, and a new one is not (issue 40)."""
    if isinstance(record, Ages):
        return position.repeated
    position.repeated = False
    if not isinstance(record, Removals):
        return False
    run, end = record.writer.run, record.first_serial + len(record.counts)
    if end <= position.serials.get(run, 0):
        position.repeated = True
        return True
    position.serials.pop(run, None)  # newest last: the oldest writer is the one forgotten
    position.serials[run] = end
    if len(position.serials) > MAX_RUNS_PER_FILE:
        del position.serials[next(iter(position.serials))]
    return False


def read_records(path: Path, position: JournalPosition, max_bytes: int) -> Iterator[Record | None]:
    """Every complete record of one journal file from ``position`` on (None for each corrupt one), reading
    at most to offset ``max_bytes``: :func:`read_new_records` until the file's end (``kvobs explain``)."""
    while position.offset < max_bytes:
        before = position.offset, position.skipping
        yield from read_new_records(path, position, min(MAX_LINE_BYTES, max_bytes - position.offset))
        if (position.offset, position.skipping) == before:
            return


def _open_regular(path: Path) -> Any:
    """Open a regular file for reading without following a symlink (OSError otherwise)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{path}: not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


# -- failure reports ----------------------------------------------------------------------


class Summary(NamedTuple):
    counts: list[tuple[str, str, int]]  # (cause, group, keys)
    ages: dict[str, Histogram]  # group -> eviction ages


class Report(NamedTuple):
    """A failure report as the sidecar folds it (the whole report is served as read)."""

    name: str
    engine: str
    model_name: str
    time: float
    cause: str
    summary: Summary
    data: dict[str, Any]
    trace_id: str | None = None  # the failure span's, when it was sampled
    unknown: tuple[str, ...] = ()
    """Causes this reader does not know (a newer engine's), as unknown items: kept and exported."""
    invalid: int = 0
    """Strings of the file that were not valid text, replaced (kvobs.wire.format.load_json)."""


def _summary(raw: Any) -> Summary | None:
    if not isinstance(raw, dict) or not isinstance(raw.get("counts"), list) or not isinstance(raw.get("ages"), dict):
        return None
    counts: list[tuple[str, str, int]] = []
    for row in raw["counts"]:
        if not (isinstance(row, list) and len(row) == 3 and is_label(row[0], MAX_SHORT_LABEL) and is_count(row[2])
                and isinstance(row[1], int) and not isinstance(row[1], bool) and 0 <= row[1] < 2**32):
            return None
        counts.append((row[0], str(row[1]), int(row[2])))
    ages: dict[str, Histogram] = {}
    for group, value in raw["ages"].items():
        hist = Histogram.from_json(value)
        if hist is None or not group.isdigit():
            return None
        ages[group] = hist
    return Summary(counts, ages)


def _summary_of_listed(missing: Any) -> Summary | None:
    """The summary of a report written before reports carried one (format 1, all keys listed)."""
    if not isinstance(missing, list):
        return None
    counts: Counter[tuple[str, str]] = Counter()
    ages: dict[str, Histogram] = {}
    for key in missing:
        if not isinstance(key, dict):
            return None
        cause, group, age = key.get("cause"), key.get("group"), key.get("seconds_since_eviction")
        if not is_label(cause, MAX_SHORT_LABEL) or not is_count(group) or not (age is None or is_seconds(age)):
            return None
        counts[(cause, str(int(group)))] += 1
        if age is not None:
            ages.setdefault(str(int(group)), Histogram()).observe(float(age))
    return Summary([(c, g, n) for (c, g), n in counts.items()], ages)


def decode_report(name: str, data: Any) -> Report | None:
    """A parsed failure report, validated, or None if it is not a kvobs report."""
    if not isinstance(data, dict) or data.get("kind", "failure") != "failure":
        return None
    engine, when, cause = data.get("engine"), data.get("time"), data.get("cause")
    model = data.get("model_name", "")
    if not is_engine_label(engine) or not is_seconds(when) or not isinstance(model, str):
        return None
    if not is_label(cause, MAX_SHORT_LABEL):
        return None
    model = fit_model_name(model)
    for name_ in ("history_keys", "num_keys", "num_missing"):
        if name_ in data and not is_count(data[name_]):
            return None
    if "history_window_s" in data and not is_seconds(data["history_window_s"]):
        return None
    trace_id, span_id = data.get("trace_id"), data.get("span_id")
    if not (trace_id is None or is_hex_id(trace_id, 32)) or not (span_id is None or is_hex_id(span_id, 16)):
        return None
    if "missing_summary" in data:
        summary = _summary(data["missing_summary"])
    else:
        summary = _summary_of_listed(data.get("missing"))
    if summary is None or not isinstance(data.get("missing", []), list):
        return None
    for key in data.get("missing", []):
        age = key.get("seconds_since_eviction") if isinstance(key, dict) else "bad"
        if not (age is None or is_seconds(age)):
            return None
    causes = dict.fromkeys([cause, *(row[0] for row in summary.counts)])
    unknown = tuple(unknown_item("label_value", f"cause={c}") for c in causes
                    if c not in CAUSES and c not in EXCEPTION_CAUSES)
    return Report(name, engine, model, float(when), cause, summary, data, trace_id, unknown)


def read_report(path: Path) -> Report:
    """A failure report file, validated; OSError if it cannot be read as a regular file,
    ValueError if it is too large or not a kvobs report."""
    with _open_regular(path) as f:
        if os.fstat(f.fileno()).st_size > MAX_REPORT_BYTES:
            raise ValueError(f"larger than {MAX_REPORT_BYTES} bytes")
        raw = f.read(MAX_REPORT_BYTES + 1)
    try:
        data, invalid = load_json(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError("not JSON") from exc
    report = decode_report(path.stem, data)
    if report is None:
        raise ValueError("not a kvobs failure report")
    return report._replace(invalid=invalid) if invalid else report


def list_reports(failures_dir: Path) -> tuple[list[Path], list[Path]]:
    """The report files in ``failures_dir``, newest first, and the other ``*.json`` files there.

    The one rule of the sidecar's ingest, its API and ``kvobs explain --dir``: a report is a file named
    as kvobs names them (:data:`REPORT_ID`; ids, hence names, sort in write order), so every report listed is
    one the API's ``before`` accepts; any other file is not a kvobs report (a reader that counts what
    it skips counts it). Dot files are writes in progress, neither.
    """
    try:
        files = [p for p in failures_dir.glob("*" + REPORT_SUFFIX) if not p.name.startswith(".")]
    except OSError:
        return [], []
    # By id, not file name: the API's ``before`` compares ids ("-" sorts before ".json"'s ".").
    reports = sorted((p for p in files if REPORT_ID.fullmatch(p.stem)), key=lambda p: p.stem, reverse=True)
    return reports, sorted(p for p in files if not REPORT_ID.fullmatch(p.stem))


def report_files(failures_dir: Path) -> list[Path]:
    """The report files in ``failures_dir``, newest first (:func:`list_reports`)."""
    return list_reports(failures_dir)[0]


def iter_reports(failures_dir: Path) -> Iterator[dict[str, Any]]:
    """Readable, valid failure reports, newest first, each with its ``id`` (the file's stem);
    anything else (unreadable, a symlink, damaged) is skipped."""
    for path in report_files(failures_dir):
        try:
            report = read_report(path)
        except (OSError, ValueError):
            continue
        yield {**report.data, "id": path.stem}
