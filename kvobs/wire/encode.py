"""The engine's side of the wire: journal lines and failure reports built from the engine's objects
(a :class:`~kvobs.hot_path_loader.RemovalRun`, a :class:`~kvobs.diagnosis.Diagnosis`).

Called by ``kvobs.journal`` only (the removals on its writer thread). Lives in the wire package
next to the format and its decoder, so a format change is made in one package, and a round trip
(``tests/unit/test_wire.py``) reads back what is written here. numpy is imported inside
:func:`encode_removals`, never at import; the sidecar does not import this module at all.
"""

from __future__ import annotations

import base64
import json
from collections import Counter
from collections.abc import Iterator, Mapping
from json.encoder import encode_basestring_ascii
from typing import TYPE_CHECKING, Any

from kvobs.codes import BUCKETS, REASONS, unpack_flags
from kvobs.wire.format import (
    AGES_PER_LINE,
    EXTENSION,
    FORMAT_VERSION,
    FROZEN_READER_LABELS,
    KEY_REF_BYTES,
    KEYS_LISTED,
    MAX_BATCHES_PER_LINE,
    MAX_DETAIL,
    MAX_LABEL,
    MAX_LINE_BYTES,
    MAX_REPORT_KEYS,
    MAX_REQ_ID,
    Writer,
    fit_req_id,
    fit_text,
    key_ref,
    key_ref_bytes,
)
from kvobs.wire.histogram import Histogram

if TYPE_CHECKING:
    from kvobs.boundary import OffloadException
    from kvobs.diagnosis import Diagnosis
    from kvobs.hot_path_loader import RemovalRun


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _dumps(record: dict[str, Any]) -> str:
    return json.dumps(record, separators=(",", ":"), allow_nan=False)


def _head(kind: str, writer: Writer) -> dict[str, Any]:
    head = {"k": kind, "e": writer.engine, "pid": writer.pid, "run": writer.run}
    if writer.model_name:
        head["m"] = writer.model_name
    return head


def encode_hello(writer: Writer, time: float, *, version: str, vllm_version: str, history_size: int,
                 hot_path: str, observing: bool = True, reason: str = "ok", detail: str = "") -> str:
    return _dumps({**_head("hello", writer), "t": time, "format": FORMAT_VERSION,
                   "version": fit_text(version, MAX_LABEL, "version"),
                   "vllm_version": fit_text(vllm_version, MAX_LABEL, "vllm_version"), "history_size": history_size,
                   "hot_path": fit_text(hot_path, MAX_LABEL, "hot_path"), "observing": observing, "reason": reason,
                   "detail": detail[:MAX_DETAIL]})


def encode_totals(writer: Writer, time: float, counters: Mapping[str, Mapping[str, int]], *,
                  history_keys: int, history_window_s: float, seq: int) -> str:
    """``seq``: this writer's count of totals lines so far (``Totals.seq``).

    Written so that every reader since format 2 keeps reading (docs/design.md, "Wire compatibility"):
    zero counts are left out (a reader takes a missing label as 0), and a count under a label value
    kvobs 0.1.0's reader would refuse the line for goes under :data:`EXTENSION`, which that reader
    ignores and today's adds in. A totals map that reader does not know at all is written as it is:
    it ignores it.
    """
    line: dict[str, Any] = {**_head("totals", writer), "t": time, "q": seq}
    extension: dict[str, dict[str, int]] = {}
    for name, counts in counters.items():
        frozen = FROZEN_READER_LABELS.get(name)
        line[name] = {label: n for label, n in counts.items() if n and (frozen is None or label in frozen)}
        if frozen is not None and (newer := {label: n for label, n in counts.items() if n and label not in frozen}):
            extension[name] = newer
    if extension:
        line[EXTENSION] = extension
    return _dumps({**line, "hist_keys": history_keys, "hist_window": history_window_s})


LINE_BUDGET = MAX_LINE_BYTES // 2
"""What a ``removals`` line is kept under: far below the MAX_LINE_BYTES its reader skips."""
_BATCH_BYTES = 40  # a batch's time, flags, count and listed count in base64, and its request id's comma
_KEY_BYTES = 24  # a listed key's reference and residency in base64
_MAX_BYTES_PER_CHAR = 12
"""The most one character of a str costs as :func:`_dumps` writes it: ``\\ud83d\\ude00`` for an emoji."""


def encode_removals(writer: Writer, run: RemovalRun, wall_offset: float) -> list[str]:
    """``removals`` lines for a drained run (plus ``ages`` lines for batches over KEYS_LISTED keys).

    As many lines as it takes to keep each within what the reader takes (``LINE_BUDGET``,
    ``MAX_BATCHES_PER_LINE``): a drained run can hold thousands of batches, each with a request
    id of up to ``MAX_REQ_ID`` characters, and one line over the reader's limit would lose them all.
    """
    return [line for part in _line_runs(run) for line in _encode_run(writer, part, wall_offset)]


def _written_bytes(text: str | None) -> int:
    """The bytes :func:`_dumps` writes for ``text`` (the reader's line limit is in bytes): JSON's
    ``ensure_ascii`` writes a non-ASCII character as 6 bytes (12 outside the BMP), a control
    character as 6, a quote or backslash as 2."""
    return 4 if text is None else len(encode_basestring_ascii(text))


def _line_runs(run: RemovalRun) -> Iterator[RemovalRun]:
    """``run`` cut into consecutive runs whose lines fit (the run itself when it fits, as most do)."""
    n = len(run.counts)
    keys = sum(min(count, KEYS_LISTED) for count in run.counts)
    worst = sum(min(len(req or ""), MAX_REQ_ID) for req in run.reqs) * _MAX_BYTES_PER_CHAR + 2 * n
    if n <= MAX_BATCHES_PER_LINE and n * _BATCH_BYTES + keys * _KEY_BYTES + worst <= LINE_BUDGET:
        yield run  # fits however its ids are escaped: nothing encoded to find out
        return
    written: dict[str | None, int] = {}  # a run's batches often share a request id
    sizes = [_BATCH_BYTES + min(count, KEYS_LISTED) * _KEY_BYTES
             + (written[req] if req in written else written.setdefault(req, _written_bytes(fit_req_id(req))))
             for count, req in zip(run.counts, run.reqs, strict=True)]
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



def _report_head(writer: Writer, wall_time: float) -> dict[str, Any]:
    """The fields that open every failure report: what it is, its format, whose and when."""
    return {"kind": "failure", "format": FORMAT_VERSION, "engine": writer.engine, "model_name": writer.model_name,
            "pid": writer.pid, "time": wall_time}


def failure_report(
    diagnosis: Diagnosis, exc: BaseException, writer: Writer, wall_time: float, trace: tuple[str, str] | None = None
) -> dict[str, Any]:
    """Every field of the message as structured data (``GET /api/v1/failures`` serves these).

    ``trace``: the (trace_id, span_id) of the failure's span (``kvobs.tracing``) when it was sampled:
    the report, and the sidecar's exemplar, name the trace the tracing backend holds."""
    failure = diagnosis.failure
    return {
        **_report_head(writer, wall_time),
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
                "expected_tier": k.facts.expected_tier,
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


def exception_report(
    failure: OffloadException, exc: BaseException, writer: Writer, wall_time: float,
    trace: tuple[str, str] | None = None,
) -> dict[str, Any]:
    """A failure report for an exception at the connector's boundary (kvobs/vllm/boundary.py).

    The fields every reader of a failure report needs are there (``kind`` failure, ``cause`` one of
    ``kvobs.codes.EXCEPTION_CAUSES``, an empty ``missing_summary`` and ``missing``), so every sidecar since
    0.1.0 reads it (an older one as a failure with a cause it does not know); the rest are new fields,
    which readers pass over (docs/design.md, "Wire compatibility")."""
    req_ids = [fit_req_id(r) for r in failure.req_ids]
    return {
        **_report_head(writer, wall_time),
        "exception_type": failure.exception_type,
        "vllm_message": failure.vllm_message,
        "message": failure.message,
        "req_id": req_ids[0] if req_ids else None,
        "group": None,
        "cause": failure.cause,
        "causes": {failure.cause: 1},
        "recomputed": failure.recomputed,
        "trace_id": None if trace is None else trace[0],
        "span_id": None if trace is None else trace[1],
        "num_keys": 0,
        "num_missing": 0,
        "missing_not_listed": 0,
        "missing_summary": {"counts": [], "ages": {}, "bounds": list(BUCKETS)},
        "missing": [],
        "site": None if failure.site is None else failure.site.to_json(),
        "site_label": failure.label,
        "raised_at": None if failure.raised_at is None else failure.raised_at.to_json(),
        "side": failure.side,
        "method": failure.method,
        "req_ids": req_ids,
        "requests": [dict(r) for r in failure.requests],
        "events": [dict(e) for e in failure.events],
        "not_recorded": list(failure.not_recorded),
        "releases": dict(failure.releases),
        **({"extra": dict(failure.extra)} if failure.extra else {}),
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



def bounded_report(report: dict[str, Any], limit: int) -> bytes:
    """The report as JSON of at most ``limit`` bytes: the per-key list is cut first (the summary
    keeps every key's cause and age), then the texts. ``missing_not_listed`` counts what was cut."""
    data = json.dumps(report, sort_keys=True, allow_nan=False).encode()
    for listed in ("events", "requests"):  # an exception's report: its lists before its texts
        items = list(report.get(listed) or [])
        while len(data) > limit and items:
            items = items[len(items) // 2 + 1:] if listed == "events" else items[: len(items) // 2]
            report = report | {listed: items}
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


