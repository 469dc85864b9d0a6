"""What the sidecar knows, folded from validated journal records and failure reports.

Counters come from each writer's cumulative ``totals`` records: a writer (one journal sink of
one engine process) counts from zero, so an engine's counter is the sum of its writers' latest
totals. A writer stays *live* (its latest totals kept apart) while any of its journal files
exists, since only then can it write again; when its last file is gone its totals move into the
engine's *retired* sum. So totals stay exact whatever the number of writers, and memory is
bounded by the files in the directory. Histograms are aggregated here from removal runs and
reports. The whole state, with every file's read position, is checkpointed atomically, and a
checkpoint is validated like any other input when it is read back, by the journal decoder's own
checks (``kvobs.wire.decode``) wherever it holds what a journal line holds (writers, hellos, counters).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvobs import __version__
from kvobs.codes import CAUSES, EXCEPTION_CAUSES, REASONS
from kvobs.metric_catalogue import METRICS
from kvobs.wire.decode import MAX_RUNS_PER_FILE, Report, decode_counters, decode_hello, decode_writer
from kvobs.wire.format import (
    MAX_ENGINES,
    MAX_LABEL_VALUES,
    MAX_SHORT_LABEL,
    OTHER,
    TOTAL_LABELS,
    Ages,
    Hello,
    Record,
    Removals,
    Totals,
    Unknown,
    Writer,
    add_counts,
    is_count,
    is_engine_label,
    is_hex_id,
    is_label,
    is_model_name,
    is_seconds,
    kept_labels,
    load_json,
    ref_groups,
)
from kvobs.wire.histogram import Histogram

_EXCEPTIONS = next(m for m in METRICS if m.name == "kvobs_offload_exceptions")
"""Its totals key and key separator: the worker's reports are counted under the engine's own."""
logger = logging.getLogger("kvobs.sidecar")

MAX_UNKNOWN = 256
"""Distinct unknown wire items a sidecar remembers (kvobs_sidecar_unknown_wire_items counts them)."""
CHECKPOINT_FORMAT = 3
READABLE_FORMATS = (2, 3)  # format 2 knew engines by their engine label alone (model_name "")

EngineId = tuple[str, str]
"""(model_name, engine): the labels of an engine's series, as vLLM's own (``wire.Writer.identity``)."""


def _add(into: dict[str, dict[str, float]], counters: Mapping[str, Mapping[str, float]]) -> None:
    """Sum ``counters`` into ``into``, bounded as a line's maps are (kvobs.wire.format.add_counts)."""
    for name, counts in counters.items():
        add_counts(into.setdefault(name, {}), TOTAL_LABELS.get(name, ()), counts)


@dataclass
class LiveWriter:
    stem: str  # the journal file stem it writes (<engine>-<pid>[_<n>])
    totals: Totals


@dataclass
class EngineState:
    """One engine (model_name, engine): possibly several writers over time (restarts, several managers)."""

    live: dict[str, LiveWriter] = field(default_factory=dict)  # "pid/run" -> its latest totals
    retired: dict[str, dict[str, float]] = field(default_factory=dict)  # summed totals of writers gone
    hello: Hello | None = None
    started: float = 0.0
    """The earliest writer start (hello time) read for this engine, 0 before any: its counters count
    from then (every writer counts from zero and they are summed), so a count query counts a series
    new in its window in full when the engine started inside it (dashboards/promql.py)."""
    last_record_time: float = 0.0
    groups: set[str] = field(default_factory=set)
    residency: dict[str, Histogram] = field(default_factory=dict)  # reason
    missing: dict[tuple[str, str], int] = field(default_factory=dict)  # (cause, group)
    missing_age: dict[str, Histogram] = field(default_factory=dict)  # group
    exemplars: dict[str, tuple[str, float]] = field(default_factory=dict)
    """cause -> (trace_id, time) of the newest failure whose span was sampled: one per series."""
    failure_times: dict[str, tuple[float, float]] = field(default_factory=dict)
    """cause -> (newest, previous) failure report time (0: none): alerts read when failures happened,
    not when Prometheus first saw a counter move, so a Prometheus restart, a second replica or a
    scrape gap neither re-raises old failures nor hides new ones."""
    invalid: int = 0
    """Strings of this engine's lines and reports that were not valid text, replaced (kvobs.wire.format.load_json):
    exported as ``kvobs_dropped_records_total{stage="ingest"}``, the stage kvobs.codes.DROP_STAGES keeps for it."""
    worker_exceptions: dict[str, float] = field(default_factory=dict)
    """``kvobs_offload_exceptions`` of the engine's workers, by totals key (cause, site), from their failure
    reports: a worker writes no journal, so its reports are its only count (the scheduler side's are in the
    journal's totals, and its reports are not counted again)."""

    def totals(self) -> dict[str, dict[str, float]]:
        summed: dict[str, dict[str, float]] = {k: dict(v) for k, v in self.retired.items()}
        for writer in self.live.values():
            _add(summed, writer.totals.counters)
        if self.invalid:
            _add(summed, {"dropped": {"ingest": float(self.invalid)}})
        if self.worker_exceptions:
            _add(summed, {_EXCEPTIONS.totals or "": self.worker_exceptions})
        return summed

    def count_worker_exception(self, cause: str, site: Any) -> None:
        """One worker-side exception report: ``kvobs_offload_exceptions{cause, site}`` += 1, its sites bounded
        (``MAX_LABEL_VALUES``, then ``other``) as the engine bounds its own."""
        site = site if is_label(site, MAX_SHORT_LABEL - len(cause) - 1) else ""
        key = f"{cause}{_EXCEPTIONS.sep}{site}" if site else cause
        if key not in self.worker_exceptions and len(self.worker_exceptions) >= MAX_LABEL_VALUES:
            key = f"{cause}{_EXCEPTIONS.sep}{OTHER}"
        self.worker_exceptions[key] = self.worker_exceptions.get(key, 0.0) + 1

    def causes_seen(self) -> set[str]:
        """The ``cause`` values of this engine's report-fed series (its reports' causes)."""
        return {*self.failure_times, *self.exemplars, *(cause for cause, _ in self.missing)}

    def folded(self, causes: set[str], groups: set[str], reasons: set[str]) -> EngineState:
        """A copy whose report-fed and residency series keep only the ``causes``, ``groups`` and ``reasons``
        given (kept_labels), the rest summed (times: the newest two, exemplars: the newest) under OTHER.
        Its counters (``live``, ``retired``) are shared, not copied: the collector only reads them."""
        def cause(value: str) -> str:
            return value if value in causes else OTHER

        def group(value: str) -> str:
            return value if value in groups else OTHER

        out = EngineState(self.live, self.retired, self.hello, self.started, self.last_record_time,
                          {group(g) for g in self.groups}, invalid=self.invalid,
                          worker_exceptions=self.worker_exceptions)
        for (c, g), n in self.missing.items():
            key = (cause(c), group(g))
            out.missing[key] = out.missing.get(key, 0) + n
        def reason(value: str) -> str:
            return value if value in reasons else OTHER

        for target, source, kept in ((out.missing_age, self.missing_age, group),
                                     (out.residency, self.residency, reason)):
            for value, hist in source.items():
                have = target.setdefault(kept(value), Histogram())
                have.add(hist.counts, hist.total)
        for c, times in self.failure_times.items():
            newest, previous = sorted((*out.failure_times.get(cause(c), (0.0, 0.0)), *times), reverse=True)[:2]
            out.failure_times[cause(c)] = (newest, previous)
        for c, (trace, when) in self.exemplars.items():
            have_exemplar = out.exemplars.get(cause(c))
            if have_exemplar is None or when >= have_exemplar[1]:
                out.exemplars[cause(c)] = (trace, when)
        return out

    def bound(self) -> None:
        """Keep this engine's report-fed and residency labels bounded in memory, as they are exported
        (kvobs.wire.format.kept_labels: independent of the order reports and lines arrive in)."""
        if (len(self.groups) <= MAX_LABEL_VALUES and len(self.residency) <= len(REASONS) + MAX_LABEL_VALUES
                and len(self.causes_seen()) <= len(CAUSES) + MAX_LABEL_VALUES):
            return
        bounded = self.folded(kept_labels(self.causes_seen(), CAUSES), kept_labels(self.groups, ()),
                              kept_labels(self.residency, REASONS))
        self.groups, self.missing, self.missing_age = bounded.groups, bounded.missing, bounded.missing_age
        self.residency, self.failure_times, self.exemplars = bounded.residency, bounded.failure_times, bounded.exemplars

    def latest(self) -> Totals | None:
        return max((w.totals for w in self.live.values()), key=lambda t: t.time, default=None)


class SidecarState:
    """Folds records and reports; read by the metrics collector under the ingest lock."""

    def __init__(self) -> None:
        self.engines: dict[EngineId, EngineState] = {}
        self.positions: dict[str, tuple[int, bool, dict[str, int]]] = {}
        """Journal file (kvobs.sidecar.ingest.file_key: its identity) -> (offset, inside a skipped line, writer
        run -> serial after the last removal batch it gave: kvobs.wire.decode.JournalPosition)."""
        self.reports_seen: set[str] = set()
        self.records = 0
        self.skipped: Counter[tuple[str, str]] = Counter()  # (source, reason) -> records or files skipped
        self.unknown: set[str] = set()
        """What of the wire this sidecar does not know (``<what>:<name>``, kvobs.wire.format.unknown_item),
        at most ``MAX_UNKNOWN`` items: a newer engine's label values, counters, fields and kinds."""

    def note_unknown(self, items: tuple[str, ...]) -> None:
        """Remember what a record carried that this sidecar does not know; log each item once."""
        for item in items:
            if item not in self.unknown and len(self.unknown) < MAX_UNKNOWN:
                self.unknown.add(item)
                logger.warning("kvobs sidecar: the journal carries %s, which this sidecar (kvobs %s) does not know: "
                               "a newer engine's; the rest of its records is read (README, 'Upgrading')",
                               item, __version__)

    def engine(self, identity: EngineId) -> EngineState:
        """``identity``'s state; beyond ``MAX_ENGINES`` engines, a new one's records fold into the ``other``
        engine's (said once: a directory of that many engines is more likely a mistake than a node)."""
        state = self.engines.get(identity)
        if state is None:
            if len(self.engines) >= MAX_ENGINES and identity != (OTHER, OTHER):
                if (OTHER, OTHER) not in self.engines:
                    logger.warning("kvobs sidecar: more than %d engines write to this directory; the records of "
                                   "engine %r (model %r) and of any later one are summed under model_name and "
                                   "engine 'other'", MAX_ENGINES, identity[1], identity[0])
                return self.engine((OTHER, OTHER))
            state = self.engines[identity] = EngineState()
        return state

    def apply(self, record: Record | None, stem: str) -> None:
        """Fold one journal record read from a file of ``stem`` (None: a corrupt line, counted)."""
        if record is None:
            self.skipped["journal", "corrupt"] += 1
            return
        self.records += 1
        if record.unknown:
            self.note_unknown(record.unknown)
        if isinstance(record, Unknown):
            return
        state = self.engine(record.writer.identity)
        state.invalid += record.invalid
        if isinstance(record, Removals):
            if record.times:
                state.last_record_time = max(state.last_record_time, record.times[-1])
            at = 0
            for reason, listed in zip(record.reasons, record.listed, strict=True):
                ages = record.ages[at : at + listed]
                at += listed
                if ages:
                    hist = state.residency.get(reason)
                    if hist is None:
                        hist = state.residency[reason] = Histogram()
                    hist.observe_many(ages)
            state.groups.update(map(str, ref_groups(record.keys)))
            state.bound()
            return
        if isinstance(record, Ages):
            hist = state.residency.get(record.reason)
            if hist is None:
                hist = state.residency[record.reason] = Histogram()
            hist.observe_many(record.ages)
            state.bound()
            return
        state.last_record_time = max(state.last_record_time, record.time)
        if isinstance(record, Totals):
            writer = f"{record.writer.pid}/{record.writer.run}"
            have = state.live.get(writer)
            if have is None or record.newer_than(have.totals):  # by the writer's sequence, not read order
                state.live[writer] = LiveWriter(stem, record)
        elif isinstance(record, Hello):
            if state.hello is None or record.time >= state.hello.time:
                state.hello = record  # the newest writer's, whatever was read first
            if not state.started or record.time < state.started:
                state.started = record.time

    def retire_writers(self, stems_present: set[str]) -> None:
        """Writers none of whose journal files exist any more cannot write again: sum them up."""
        for state in self.engines.values():
            for writer in [w for w, live in state.live.items() if live.stem not in stems_present]:
                _add(state.retired, state.live.pop(writer).totals.counters)

    def apply_report(self, report: Report) -> None:
        """Fold one validated failure report (each file once)."""
        if report.name in self.reports_seen:
            return
        self.reports_seen.add(report.name)
        self.note_unknown(report.unknown)
        state = self.engine((report.model_name, report.engine))
        if report.cause in EXCEPTION_CAUSES:  # not a failed load: counted by kvobs_offload_exceptions (totals)
            state.invalid += report.invalid
            if report.data.get("side") == "worker":  # a worker has no journal: its report is its count
                state.count_worker_exception(report.cause, report.data.get("site_label"))
            return
        for cause, group, n in report.summary.counts:
            state.groups.add(group)
            state.missing[(cause, group)] = state.missing.get((cause, group), 0) + n
        for group, hist in report.summary.ages.items():
            have = state.missing_age.get(group)
            if have is None:
                have = state.missing_age[group] = Histogram()
            have.add(hist.counts, hist.total)
        newest_t, previous_t = state.failure_times.get(report.cause, (0.0, 0.0))
        if report.time >= newest_t:
            state.failure_times[report.cause] = (report.time, newest_t)
        elif report.time > previous_t:  # reports are read in name (time) order, but a late one may arrive
            state.failure_times[report.cause] = (newest_t, report.time)
        if report.trace_id is not None:
            newest = state.exemplars.get(report.cause)
            if newest is None or report.time >= newest[1]:
                state.exemplars[report.cause] = (report.trace_id, report.time)
        state.invalid += report.invalid
        state.bound()

    # -- checkpoint -------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {
            "format": CHECKPOINT_FORMAT,
            "saved_at": time.time(),
            "positions": {name: [offset, skipping, serials]
                          for name, (offset, skipping, serials) in self.positions.items()},
            "reports_seen": sorted(self.reports_seen),
            "records": self.records,
            "skipped": [[source, reason, n] for (source, reason), n in self.skipped.items()],
            "unknown": sorted(self.unknown),
            "engines": [
                {
                    "model_name": identity[0],
                    "engine": identity[1],
                    "live": {
                        writer: {"stem": w.stem, "pid": w.totals.writer.pid, "run": w.totals.writer.run,
                                 "t": w.totals.time, "q": w.totals.seq, "counters": w.totals.counters,
                                 "hist_keys": w.totals.history_keys, "hist_window": w.totals.history_window_s}
                        for writer, w in e.live.items()
                    },
                    "retired": e.retired,
                    "hello": None if e.hello is None else _hello_json(e.hello),
                    "started": e.started,
                    "last_record_time": e.last_record_time,
                    "groups": sorted(e.groups),
                    "residency": {r: h.to_json() for r, h in e.residency.items()},
                    "missing": [[c, g, n] for (c, g), n in e.missing.items()],
                    "missing_age": {g: h.to_json() for g, h in e.missing_age.items()},
                    "exemplars": [[c, t, when] for c, (t, when) in e.exemplars.items()],
                    "failure_times": [[c, newest, previous] for c, (newest, previous) in e.failure_times.items()],
                    "invalid": e.invalid,
                    "worker_exceptions": e.worker_exceptions,
                }
                for identity, e in self.engines.items()
            ],
        }

    @classmethod
    def from_json(cls, data: Any) -> SidecarState:
        """A checkpoint read back; ValueError if any part of it is not what to_json writes."""
        return _Restore(data).state


def _hello_json(hello: Hello) -> dict[str, Any]:
    """A hello as the checkpoint keeps it: its fields as a journal line's (what it did not know is in ``unknown``)."""
    fields = hello._asdict()
    del fields["unknown"]
    return fields | {"writer": list(hello.writer)}


def _group(value: Any) -> bool:
    """A ``group`` label value: a KV-cache group index, or OTHER for those beyond the bound (kept_labels)."""
    return isinstance(value, str) and (value.isdigit() or value == OTHER)


def _short(value: Any) -> bool:
    """A label value as a totals line may carry it (a newer engine's too)."""
    return is_label(value, MAX_SHORT_LABEL)


class _Restore:
    """Reads a checkpoint with the same rules as any other input: every number checked."""

    def __init__(self, data: Any) -> None:
        if not isinstance(data, dict) or data.get("format") not in READABLE_FORMATS:
            raise ValueError("not a kvobs sidecar checkpoint of a format this sidecar reads")
        state = self.state = SidecarState()
        for name, pos in self._dict(data, "positions").items():
            if not (isinstance(pos, list) and len(pos) in (2, 3) and is_count(pos[0]) and isinstance(pos[1], bool)):
                raise ValueError(f"bad position of {name!r}")
            serials = pos[2] if len(pos) == 3 else {}  # absent before issue 40
            if not (isinstance(serials, dict) and len(serials) <= MAX_RUNS_PER_FILE
                    and all(_short(run) and is_count(n) for run, n in serials.items())):
                raise ValueError(f"bad serials of {name!r}")
            state.positions[str(name)] = (int(pos[0]), pos[1], {run: int(n) for run, n in serials.items()})
        seen = data.get("reports_seen")
        if not isinstance(seen, list) or not all(isinstance(s, str) for s in seen):
            raise ValueError("bad reports_seen")
        state.reports_seen = set(seen)
        state.records = self._count(data.get("records"))
        for row in data.get("skipped") or []:
            if not (isinstance(row, list) and len(row) == 3 and is_label(row[0]) and is_label(row[1])):
                raise ValueError("bad skipped counts")
            state.skipped[(row[0], row[1])] = self._count(row[2])
        unknown = data.get("unknown") or []  # absent before kvobs 0.2
        if not isinstance(unknown, list) or not all(is_label(u, 2 * MAX_SHORT_LABEL) for u in unknown):
            raise ValueError("bad unknown wire items")
        state.unknown = set(unknown[:MAX_UNKNOWN])
        engines: Any
        if data["format"] == 2:
            engines = [e | {"engine": name, "model_name": ""} if isinstance(e, dict) else e
                       for name, e in self._dict(data, "engines").items()]
        else:
            engines = data.get("engines")
            if not isinstance(engines, list):
                raise ValueError("bad engines")
        for e in engines:
            if not (isinstance(e, dict) and is_engine_label(e.get("engine")) and is_model_name(e.get("model_name"))):
                raise ValueError("bad engine labels")
            self._engine(state.engine((e["model_name"], e["engine"])), e)

    @staticmethod
    def _dict(data: Any, key: str) -> dict[str, Any]:
        value = data.get(key) if isinstance(data, dict) else None
        if not isinstance(value, dict):
            raise ValueError(f"bad {key}")
        return value

    @staticmethod
    def _count(value: Any) -> int:
        if not is_count(value):
            raise ValueError(f"bad count {value!r:.40}")
        return int(value)

    @staticmethod
    def _seconds(value: Any) -> float:
        if not is_seconds(value):
            raise ValueError(f"bad time {value!r:.40}")
        return float(value)

    @staticmethod
    def _counters(value: Any) -> dict[str, dict[str, float]]:
        """Counters as a totals line carries them, by the journal decoder's rules (label values included)."""
        if not isinstance(value, dict) or not set(value) <= set(TOTAL_LABELS):
            raise ValueError("bad counters")
        out: dict[str, dict[str, float]] = {}
        for name, counts in value.items():
            decoded = decode_counters(name, counts)
            if decoded is None:
                raise ValueError(f"bad {name} counters")
            out[name] = decoded
        return out

    @staticmethod
    def _hist(value: Any) -> Histogram:
        hist = Histogram.from_json(value)
        if hist is None:
            raise ValueError("bad histogram")
        return hist

    def _engine(self, engine: EngineState, e: Any) -> None:
        if not isinstance(e, dict):
            raise ValueError("bad engine state")
        for writer, w in self._dict(e, "live").items():
            # The engine is the EngineState's; the pid and run are checked as a journal line's.
            who = decode_writer("0", w.get("pid"), w.get("run") or None) if isinstance(w, dict) else None  # "": none
            if who is None or not isinstance(w.get("run"), str) or not is_label(w.get("stem")):
                raise ValueError("bad live writer")
            engine.live[str(writer)] = LiveWriter(w["stem"], Totals(
                Writer("", who.pid, who.run), self._seconds(w.get("t")), self._counters(w.get("counters")),
                float(self._count(w.get("hist_keys"))), self._seconds(w.get("hist_window")),
                self._count(w.get("q", 0)),
            ))
        engine.retired = self._counters(e.get("retired"))
        hello = e.get("hello")
        if hello is not None:
            # Read with the journal decoder's rules for a hello line (a label value it refuses is refused here).
            by = hello.get("writer") if isinstance(hello, dict) else None
            if not isinstance(by, list) or len(by) not in (3, 4):
                raise ValueError("bad hello")
            hello_writer = decode_writer(by[0], by[1], None if by[2] == "" else by[2], by[3] if len(by) > 3 else "")
            restored = None if hello_writer is None else decode_hello(hello_writer, hello.get("time"), hello)
            if restored is None:
                raise ValueError("bad hello")
            engine.hello = restored
        engine.started = self._seconds(e.get("started", 0.0))  # absent from older checkpoints: unknown
        engine.last_record_time = self._seconds(e.get("last_record_time"))
        groups = e.get("groups")
        if not isinstance(groups, list) or not all(_group(g) for g in groups):
            raise ValueError("bad groups")
        engine.groups = set(groups)
        for reason, h in self._dict(e, "residency").items():
            if not is_label(reason, MAX_SHORT_LABEL):
                raise ValueError("bad residency reason")
            engine.residency[reason] = self._hist(h)
        for row in e.get("missing") or []:
            if not (isinstance(row, list) and len(row) == 3 and _short(row[0]) and _group(row[1])):
                raise ValueError("bad missing counts")
            engine.missing[(row[0], row[1])] = self._count(row[2])
        for group, h in self._dict(e, "missing_age").items():
            if not _group(group):
                raise ValueError("bad group")
            engine.missing_age[group] = self._hist(h)
        for row in e.get("exemplars") or []:  # absent from checkpoints written before exemplars
            if not (isinstance(row, list) and len(row) == 3 and _short(row[0]) and is_hex_id(row[1], 32)):
                raise ValueError("bad exemplar")
            engine.exemplars[row[0]] = (row[1], self._seconds(row[2]))
        for row in e.get("failure_times") or []:  # absent from checkpoints written before these times
            if not (isinstance(row, list) and len(row) == 3 and _short(row[0])):
                raise ValueError("bad failure times")
            engine.failure_times[row[0]] = (self._seconds(row[1]), self._seconds(row[2]))
        engine.invalid = self._count(e.get("invalid", 0))  # absent before issue 40
        for key, n in (self._dict(e, "worker_exceptions") if "worker_exceptions" in e else {}).items():  # new here
            if not is_label(key, MAX_SHORT_LABEL) or len(engine.worker_exceptions) >= MAX_LABEL_VALUES + 2:
                raise ValueError("bad worker exceptions")
            engine.worker_exceptions[key] = self._count(n)
        engine.bound()  # a checkpoint of a sidecar before issue 40 may hold more


def load_checkpoint(path: Path) -> SidecarState | None:
    """The saved state, None if there is none; ValueError if it cannot be trusted (the caller counts it)."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    try:
        data, _ = load_json(raw)  # one written before issue 40 may hold a lone surrogate: replaced
    except (ValueError, RecursionError) as exc:
        raise ValueError("not JSON") from exc
    return SidecarState.from_json(data)
