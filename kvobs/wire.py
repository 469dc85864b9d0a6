"""The engine -> sidecar wire format, in one place: journal lines, failure reports, their readers.

Written by the engine (``kvobs.journal``), read by the sidecar (``kvobs.sidecar``) and by
``kvobs explain``. Everything read from disk is validated here, field by field: a line or a
report that does not fit (wrong type, non-finite or out-of-range number, inconsistent
columns) is ``None`` to its reader, which skips and counts it; nothing malformed reaches
a metric, a checkpoint or a response.

Journal: JSON lines, one record a line (a partial last line is left for later, so a crash
mid-append loses nothing already complete). Kinds:

* ``hello``: a writer started (versions, options, which hot path runs, whether it observes);
* ``totals``: cumulative counters of one writer (``pid`` + ``run``), so a reader is exact
  even when other records were dropped, and never double counts;
* ``removals``: a run of removal batches as little-endian binary columns in base64 (batch
  times, flags, key counts, the requests as a JSON list, and per listed key an 8-byte hash
  prefix, its 4-byte group and its residency as float32, NaN where unknown); at most
  ``KEYS_LISTED`` keys are listed per batch, and ``ages`` lines carry the rest of a huge
  batch's residencies;
* ``near_miss`` and ``failure``: notes for the sidecar's log and tests.

Pure: no numpy at import (the sidecar must not load it), no vLLM.
"""

from __future__ import annotations

import base64
import binascii
import bisect
import contextlib
import hashlib
import json
import logging
import os
import re
import stat
import sys
from array import array
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from kvobs.codes import BUCKETS, CAUSES, DROP_STAGES, PATHS, REASONS, STAGES, SURVIVE_COUNTS, unpack_flags

if TYPE_CHECKING:
    from typing_extensions import TypeIs

    from kvobs.diagnosis import Diagnosis
    from kvobs.recording import RemovalRun

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
_LITTLE = sys.byteorder == "little"

# -- the text limits writer and reader share (one definition each; the writer fits to them) --

MAX_LABEL = 256
"""An ``engine`` label or another short text field (kvobs's own engine labels are 1-64 characters)."""
MAX_MODEL_NAME = 4096
"""A ``model_name`` label: PATH_MAX, so any model path vLLM takes as its served name fits whole and
kvobs's label still joins vLLM's (the ``model_name`` option has the same limit, kvobs.options)."""
MAX_REQ_ID = 4096
"""A request id in a removals line or a report: clients choose them, so longer ones are fitted."""
MAX_DETAIL = 500
"""Why an engine runs unobserved (a ``hello``'s ``detail``)."""
ENGINE_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}")
"""An ``engine`` label kvobs writes (the option is checked against it): it names the engine's journal
files and reports, so it must be a safe file name."""
REPORT_ID = re.compile(rf"\d{{15}}-(?:{ENGINE_LABEL.pattern})-\d{{1,10}}-\d{{1,10}}")
"""A failure report's id, the stem of its file name (:func:`report_name`); ids sort by time."""


def report_name(wall_time: float, engine: str, pid: int, n: int) -> str:
    """The file name of a failure report: its millisecond wall time first, so names sort by time."""
    return f"{int(wall_time * 1000):015d}-{engine}-{pid}-{n}.json"


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


def is_count(value: Any) -> TypeIs[int | float]:
    """A non-negative integer (JSON may write it as 3 or 3.0) within float64's exact range."""
    return is_number(value, 0, MAX_COUNT, integer=True)


def is_seconds(value: Any, *, signed: bool = False) -> TypeIs[int | float]:
    """A finite number of seconds within ``MAX_SECONDS`` (non-negative unless ``signed``)."""
    return is_number(value, -MAX_SECONDS if signed else 0.0, MAX_SECONDS)


def is_label(value: Any, max_len: int = MAX_LABEL) -> TypeIs[str]:
    return isinstance(value, str) and 0 < len(value) <= max_len


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


def _counter_map(value: Any, labels: Sequence[str] | None = None) -> dict[str, float] | None:
    if not isinstance(value, dict):
        return None
    out: dict[str, float] = {}
    for label, count in value.items():
        if not is_label(label, 64) or not is_count(count) or (labels is not None and label not in labels):
            return None
        out[label] = float(count)
    return out


# -- columns ------------------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


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


# -- journal records ----------------------------------------------------------------------


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


class Totals(NamedTuple):
    writer: Writer
    time: float
    counters: dict[str, dict[str, float]]  # by TOTAL_KEYS: evicted, batches, near, failures, errors, dropped, survive
    history_keys: float
    history_window_s: float
    seq: int = 0
    """The writer's sequence number of this totals line (0 from writers before it had one): a reader
    keeps the highest, so a line read late (another file, a backlog) never replaces a newer one."""

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


class Note(NamedTuple):
    """A near miss or a failure, as the journal notes it (the counters travel in totals)."""

    writer: Writer
    kind: str
    time: float
    fields: dict[str, Any]


Record = Hello | Totals | Removals | Ages | Note
TOTAL_KEYS = ("evicted", "batches", "near", "failures", "errors", "dropped", "survive")
_TOTAL_LABELS: dict[str, Sequence[str] | None] = {
    "evicted": REASONS, "batches": REASONS, "near": REASONS, "failures": CAUSES, "errors": STAGES,
    "dropped": DROP_STAGES, "survive": SURVIVE_COUNTS,
}


def _dumps(record: dict[str, Any]) -> str:
    return json.dumps(record, separators=(",", ":"), allow_nan=False)


def _head(kind: str, writer: Writer) -> dict[str, Any]:
    head = {"k": kind, "e": writer.engine, "pid": writer.pid, "run": writer.run}
    if writer.model_name:
        head["m"] = writer.model_name
    return head


OBSERVING_REASONS = ("ok", "unsupported_vllm", "error")
"""The ``reason`` label of ``kvobs_observing``: observing, or why kvobs stepped aside."""


def encode_hello(writer: Writer, time: float, *, version: str, vllm_version: str, history_size: int,
                 hot_path: str, observing: bool = True, reason: str = "ok", detail: str = "") -> str:
    return _dumps({**_head("hello", writer), "t": time, "format": FORMAT_VERSION,
                   "version": fit_text(version, MAX_LABEL, "version"),
                   "vllm_version": fit_text(vllm_version, MAX_LABEL, "vllm_version"), "history_size": history_size,
                   "hot_path": fit_text(hot_path, MAX_LABEL, "hot_path"), "observing": observing, "reason": reason,
                   "detail": detail[:MAX_DETAIL]})


def encode_totals(writer: Writer, time: float, counters: Mapping[str, Mapping[str, int]], *,
                  history_keys: int, history_window_s: float, seq: int) -> str:
    """``seq``: this writer's count of totals lines so far (``Totals.seq``)."""
    return _dumps({**_head("totals", writer), "t": time, "q": seq,
                   **{k: dict(counters.get(k, {})) for k in TOTAL_KEYS},
                   "hist_keys": history_keys, "hist_window": history_window_s})


def encode_note(writer: Writer, kind: str, time: float, **fields: Any) -> str:
    assert kind in ("near_miss", "failure")
    return _dumps({**_head(kind, writer), "t": time, **fields})


LINE_BUDGET = MAX_LINE_BYTES // 2
"""What a ``removals`` line is kept under: far below the MAX_LINE_BYTES its reader skips."""
_BATCH_CHARS = 40  # a batch's time, flags, count and listed count in base64, and its request id's quotes
_KEY_CHARS = 24  # a listed key's reference and residency in base64


def encode_removals(writer: Writer, run: RemovalRun, wall_offset: float) -> list[str]:
    """``removals`` lines for a drained run (plus ``ages`` lines for batches over KEYS_LISTED keys).

    As many lines as it takes to keep each within what the reader takes (``LINE_BUDGET``,
    ``MAX_BATCHES_PER_LINE``): a drained run can hold thousands of batches, each with a request
    id of up to ``MAX_REQ_ID`` characters, and one line over the reader's limit would lose them all.
    """
    return [line for part in _line_runs(run) for line in _encode_run(writer, part, wall_offset)]


def _line_runs(run: RemovalRun) -> Iterator[RemovalRun]:
    """``run`` cut into consecutive runs whose lines fit (the run itself when it fits, as most do)."""
    n = len(run.counts)
    sizes = [_BATCH_CHARS + min(count, KEYS_LISTED) * _KEY_CHARS + min(len(req or ""), MAX_REQ_ID)
             for count, req in zip(run.counts, run.reqs, strict=True)]
    if n <= MAX_BATCHES_PER_LINE and sum(sizes) <= LINE_BUDGET:
        yield run
        return
    start = key_start = key_at = size = 0
    for i in range(n):
        if i > start and (size + sizes[i] > LINE_BUDGET or i - start >= MAX_BATCHES_PER_LINE):
            yield _sub_run(run, start, i, key_start, key_at)
            start, key_start, size = i, key_at, 0
        size += sizes[i]
        key_at += run.counts[i]
    yield _sub_run(run, start, n, key_start, key_at)


def _sub_run(run: RemovalRun, start: int, end: int, key_start: int, key_end: int) -> RemovalRun:
    return type(run)(
        run.first_serial + start, run.hashes[key_start:key_end], run.counts[start:end], run.times[start:end],
        run.flags[start:end], run.reqs[start:end], run.keys[key_start:key_end],
        None if run.residency is None else run.residency[key_start:key_end],
    )


def _encode_run(writer: Writer, run: RemovalRun, wall_offset: float) -> list[str]:
    """One ``removals`` line for a run that fits one (plus its ``ages`` lines).

    Runs on the journal's writer thread. numpy is imported here, not at module level: only
    the engine encodes, and the sidecar must not load numpy.
    """
    import numpy as np

    counts = np.frombuffer(run.counts, dtype=np.int64)
    n = len(counts)
    if n == 0:
        return []
    keys = run.keys or []
    ages = np.frombuffer(run.residency, dtype=np.float64) if run.residency is not None else np.full(len(keys), np.nan)
    if len(keys) != int(counts.sum()) or len(ages) != len(keys):
        raise ValueError("removal run without its keys and residencies (the sink needs_residency)")
    listed = np.minimum(counts, KEYS_LISTED)
    extra: list[str] = []
    if int(listed.sum()) != len(keys):  # a huge batch: list its first KEYS_LISTED keys, carry the rest's ages
        starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
        keep = np.concatenate([np.arange(s, s + k) for s, k in zip(starts.tolist(), listed.tolist(), strict=True)])
        flags = np.frombuffer(run.flags, dtype=np.uint8)
        for i in np.flatnonzero(counts > KEYS_LISTED).tolist():
            rest = ages[int(starts[i]) + KEYS_LISTED : int(starts[i]) + int(counts[i])].astype("<f4")
            reason = REASONS[unpack_flags(int(flags[i]))[0]]
            for at in range(0, len(rest), AGES_PER_LINE):
                extra.append(_dumps({**_head("ages", writer), "r": reason,
                                     "ages": _b64(rest[at : at + AGES_PER_LINE].tobytes())}))
        keys = [keys[j] for j in keep.tolist()]
        ages = ages[keep]
    lengths = set(map(len, keys))
    if len(lengths) == 1 and min(lengths) >= KEY_REF_BYTES:  # vLLM's keys: one length; slice them at once
        width = lengths.pop()
        grid = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(-1, width)
        refs = np.concatenate((grid[:, :8], grid[:, width - 4 :]), axis=1).tobytes()
    else:
        refs = b"".join(key_ref_bytes(key) for key in keys)
    line = {
        **_head("removals", writer),
        "s": run.first_serial,
        "n": n,
        "to": wall_offset,
        "t": _b64(np.frombuffer(run.times, dtype=np.float64).astype("<f8").tobytes()),
        "f": _b64(bytes(run.flags)),
        "c": _b64(counts.astype("<u4").tobytes()),
        "l": _b64(listed.astype("<u4").tobytes()),
        "req": [fit_req_id(r) for r in run.reqs] if any(r and len(r) > MAX_REQ_ID for r in run.reqs) else run.reqs,
        "keys": _b64(refs),
        "ages": _b64(ages.astype("<f4").tobytes()),
    }
    return [_dumps(line), *extra]


def key_ref_bytes(key: bytes) -> bytes:
    """A key as listed in removals lines: 8 bytes of block hash (zero-padded), 4 bytes of group."""
    return key[:-4][:8].ljust(8, b"\0") + key[-4:].rjust(4, b"\0")


def key_ref(key: bytes) -> str:
    """A key as reports and ``kvobs explain`` name it: its 8-byte hash prefix in hex, then its group."""
    return ref_text(key_ref_bytes(key))


def ref_text(ref: bytes) -> str:
    """A listed key (``KEY_REF_BYTES``) as text: ``<16 hex digits>/<group>``."""
    return f"{ref[:8].hex()}/{int.from_bytes(ref[8:], 'big')}"


def _writer(record: dict[str, Any]) -> Writer | None:
    engine, pid, run, model = record.get("e"), record.get("pid"), record.get("run"), record.get("m", "")
    if not is_label(engine) or not is_count(pid) or not (run is None or is_label(run, 64)):
        return None
    if not isinstance(model, str):
        return None
    return Writer(engine, int(pid), run or "", fit_model_name(model))


def decode_record(record: Any) -> Record | None:
    """A parsed journal line as its typed record, or None if any field does not fit."""
    if not isinstance(record, dict):
        return None
    writer = _writer(record)
    if writer is None:
        return None
    kind = record.get("k")
    if kind == "removals":
        return _decode_removals(writer, record)
    if kind == "ages":
        ages = _column(record.get("ages"), "f")
        if ages is None or record.get("r") not in REASONS or not all(_age_ok(a) for a in ages):
            return None
        return Ages(writer, record["r"], ages.tolist())
    time = record.get("t")
    if not is_seconds(time):
        return None
    if kind == "totals":
        counters: dict[str, dict[str, float]] = {}
        for name in TOTAL_KEYS:
            value = record.get(name)
            if value is None:
                continue
            counts = _counter_map(value, _TOTAL_LABELS[name])
            if counts is None:
                return None
            counters[name] = counts
        keys, window, seq = record.get("hist_keys", 0), record.get("hist_window", 0.0), record.get("q", 0)
        if not is_count(keys) or not is_seconds(window) or not is_count(seq):
            return None
        return Totals(writer, float(time), counters, float(keys), float(window), int(seq))
    if kind == "hello":
        texts = {k: record.get(k, "") for k in ("version", "vllm_version", "hot_path")}
        size, observing = record.get("history_size", 0), record.get("observing", True)
        reason, detail = record.get("reason", "ok"), record.get("detail", "")
        if not all(isinstance(v, str) for v in texts.values()) or not is_count(size):
            return None
        if not isinstance(observing, bool) or reason not in OBSERVING_REASONS or not isinstance(detail, str):
            return None
        texts = {k: fit_text(v, MAX_LABEL, k) for k, v in texts.items()}
        return Hello(writer, float(time), texts["version"], texts["vllm_version"], int(size), texts["hot_path"],
                     observing, reason, detail[:MAX_DETAIL])
    if kind in ("near_miss", "failure"):
        return Note(writer, kind, float(time),
                    {k: v for k, v in record.items() if k not in ("k", "e", "pid", "run", "m")})
    return None


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
    for packed in flags:
        reason, path = unpack_flags(packed)
        if reason >= len(REASONS) or path >= len(PATHS):
            return None
        reasons.append(REASONS[reason])
        paths.append(PATHS[path])
    return Removals(writer, int(first), wall, reasons, paths, counts.tolist(), reqs, listed.tolist(), key_bytes,
                    ages.tolist())


# -- reading journal files ----------------------------------------------------------------


@dataclass
class JournalPosition:
    """How far a reader got in one journal file, and whether it is inside a line it skips."""

    offset: int = 0
    skipping: bool = False


def read_new_records(path: Path, position: JournalPosition, max_bytes: int = 8 * 2**20) -> Iterator[Record | None]:
    """Complete records appended since ``position`` (None for each corrupt one); advances it.

    A partial last line (the writer is mid-append, or died mid-append) is left for the next
    call. A line of ``MAX_LINE_BYTES`` or more is no record kvobs writes: it is skipped (one
    None, however many reads it spans) rather than waited on forever. Opens with O_NOFOLLOW:
    a symlink is not a journal.
    """
    with _open_regular(path) as f:
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
        if len(line) >= MAX_LINE_BYTES:
            yield None
            continue
        try:
            parsed = json.loads(line)
        except (ValueError, RecursionError):
            yield None
            continue
        yield decode_record(parsed)


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


# -- histograms ---------------------------------------------------------------------------


@dataclass
class Histogram:
    """Bucket counts (``kvobs.codes.BUCKETS`` and +Inf) and their sum."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    total: float = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(BUCKETS, value)] += 1
        self.total += value

    def observe_many(self, values: Sequence[float]) -> None:
        counts = self.counts
        for value in values:
            if value == value:  # NaN: unknown
                counts[bisect.bisect_left(BUCKETS, value)] += 1
                self.total += value

    def add(self, counts: Sequence[int], total: float) -> None:
        self.counts = [have + more for have, more in zip(self.counts, counts, strict=True)]
        self.total += total

    def buckets(self) -> list[tuple[str, int]]:
        """(le, cumulative count) pairs, ending with +Inf."""
        out, running = [], 0
        for bound, count in zip((*BUCKETS, float("inf")), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out

    @classmethod
    def from_json(cls, value: Any) -> Histogram | None:
        """``{"counts": [...], "sum": s}`` as written by :meth:`to_json`, or None if it does not fit."""
        if not isinstance(value, dict):
            return None
        counts, total = value.get("counts"), value.get("sum", value.get("total"))
        if not (isinstance(counts, list) and len(counts) == len(BUCKETS) + 1 and all(is_count(c) for c in counts)
                and is_number(total, 0, MAX_COUNT * MAX_SECONDS)):
            return None
        return cls([int(c) for c in counts], float(total))

    def to_json(self) -> dict[str, Any]:
        return {"counts": list(self.counts), "sum": self.total}


# -- failure reports ----------------------------------------------------------------------


def failure_report(
    diagnosis: Diagnosis, exc: BaseException, writer: Writer, wall_time: float, trace: tuple[str, str] | None = None
) -> dict[str, Any]:
    """Every field of the message as structured data (``GET /api/v1/failures`` serves these).

    ``trace``: the (trace_id, span_id) of the failure's span (``kvobs.tracing``) when it was sampled:
    the report, and the sidecar's exemplar, name the trace the tracing backend holds."""
    failure = diagnosis.failure
    return {
        "kind": "failure",
        "format": FORMAT_VERSION,
        "engine": writer.engine,
        "model_name": writer.model_name,
        "pid": writer.pid,
        "time": wall_time,
        "exception_type": type(exc).__name__,
        "vllm_message": failure.vllm_message,
        "message": diagnosis.message,
        "req_id": fit_req_id(failure.req_id),
        "group": failure.failing_group,
        "cause": diagnosis.cause,
        "causes": diagnosis.causes,
        "recomputed": failure.recomputed,
        "trace_id": None if trace is None else trace[0],
        "span_id": None if trace is None else trace[1],
        "num_keys": failure.num_keys,
        "num_missing": len(diagnosis.keys),
        "end_token_range": list(failure.end_token_range) if failure.end_token_range else None,
        "history_keys": failure.history_keys,
        "history_window_s": failure.history_window_s,
        "missing_not_listed": max(0, len(diagnosis.keys) - MAX_REPORT_KEYS),
        "missing_summary": missing_summary(diagnosis),
        "missing": [
            {
                "key": key_ref(k.facts.key),
                "group": k.facts.group,
                "end_token": k.facts.end_token,
                "state": k.facts.state,
                "cause": k.cause,
                "seconds_since_eviction": k.age_s,
                "reported": None if k.facts.verdict is None else ("HIT_PENDING" if k.facts.verdict.pending else "HIT"),
                "last_removal": None
                if k.facts.last_removal is None
                else {
                    "reason": k.facts.last_removal.reason,
                    "path": k.facts.last_removal.path,
                    "req_id": fit_req_id(k.facts.last_removal.req_id),
                },
                "evidence": k.evidence,
            }
            for k in diagnosis.keys[:MAX_REPORT_KEYS]
        ],
    }


def missing_summary(diagnosis: Diagnosis) -> dict[str, Any]:
    """Every missing key, aggregated: counts by (cause, group) and eviction ages bucketed per group.

    A load can ask for tens of thousands of keys; listing each would outgrow what the sidecar
    reads (MAX_REPORT_BYTES), so the sidecar's metrics come from here.
    """
    counts = Counter((k.cause, k.facts.group) for k in diagnosis.keys)
    ages: dict[int, Histogram] = {}
    for k in diagnosis.keys:
        if k.age_s is not None:
            ages.setdefault(k.facts.group, Histogram()).observe(k.age_s)
    return {
        "counts": [[cause, group, n] for (cause, group), n in counts.items()],
        "ages": {str(group): h.to_json() for group, h in ages.items()},
        "bounds": list(BUCKETS),
    }


class Summary(NamedTuple):
    counts: list[tuple[str, str, int]]  # (cause, group, keys)
    ages: dict[str, Histogram]  # group -> eviction ages


def bounded_report(report: dict[str, Any], limit: int) -> bytes:
    """The report as JSON of at most ``limit`` bytes: the per-key list is cut first (the summary
    keeps every key's cause and age), then the texts. ``missing_not_listed`` counts what was cut."""
    data = json.dumps(report, sort_keys=True, allow_nan=False).encode()
    missing = list(report.get("missing") or [])
    while len(data) > limit and missing:
        missing = missing[: len(missing) // 2]
        report = report | {"missing": missing,
                           "missing_not_listed": report.get("num_missing", 0) - len(missing)}
        data = json.dumps(report, sort_keys=True, allow_nan=False).encode()
    if len(data) > limit:  # texts (a request id, the message) are all that is left to cut
        text_room = max(256, limit // 8)
        report = {k: (v[:text_room] if isinstance(v, str) else v) for k, v in report.items()}
        data = json.dumps(report, sort_keys=True, allow_nan=False).encode()
    return data


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


def is_hex_id(value: Any, digits: int) -> TypeIs[str]:
    """A W3C trace (32 digits) or span (16 digits) id as kvobs writes it: lowercase hex, not all zero."""
    return (isinstance(value, str) and len(value) == digits and value.strip("0123456789abcdef") == ""
            and value.strip("0") != "")


def _summary(raw: Any) -> Summary | None:
    if not isinstance(raw, dict) or not isinstance(raw.get("counts"), list) or not isinstance(raw.get("ages"), dict):
        return None
    counts: list[tuple[str, str, int]] = []
    for row in raw["counts"]:
        if not (isinstance(row, list) and len(row) == 3 and row[0] in CAUSES and is_count(row[2])
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
        if cause not in CAUSES or not is_count(group) or not (age is None or is_seconds(age)):
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
    if not is_label(engine) or not is_seconds(when) or cause not in CAUSES or not isinstance(model, str):
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
    return Report(name, engine, model, float(when), cause, summary, data, trace_id)


def read_report(path: Path) -> Report:
    """A failure report file, validated; OSError if it cannot be read as a regular file,
    ValueError if it is too large or not a kvobs report."""
    with _open_regular(path) as f:
        if os.fstat(f.fileno()).st_size > MAX_REPORT_BYTES:
            raise ValueError(f"larger than {MAX_REPORT_BYTES} bytes")
        raw = f.read(MAX_REPORT_BYTES + 1)
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ValueError("not JSON") from exc
    report = decode_report(path.stem, data)
    if report is None:
        raise ValueError("not a kvobs failure report")
    return report


def report_files(failures_dir: Path) -> list[Path]:
    """Report file names in ``failures_dir``, newest first (names start with the millisecond wall time)."""
    with contextlib.suppress(OSError):
        return sorted((p for p in failures_dir.glob("*.json") if not p.name.startswith(".")), reverse=True)
    return []


def iter_reports(failures_dir: Path) -> Iterator[dict[str, Any]]:
    """Readable, valid failure reports, newest first, each with its ``id`` (the file's stem);
    anything else (unreadable, a symlink, damaged) is skipped."""
    for path in report_files(failures_dir):
        try:
            report = read_report(path)
        except (OSError, ValueError):
            continue
        yield {**report.data, "id": path.stem}
