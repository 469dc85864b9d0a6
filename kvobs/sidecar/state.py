"""What the sidecar knows, folded from journal records and failure reports.

Counters come from the engines' cumulative ``totals`` records (exact even when
batch records were dropped, and never double counted); histograms are
aggregated here from raw batch records and reports. The whole state, with the
read offset of every journal file, is checkpointed atomically, so a restarted
sidecar resumes where its checkpoint left off instead of counting twice.
"""

from __future__ import annotations

import bisect
import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvobs.diagnosis import CAUSES
from kvobs.history import REASONS

BUCKETS: tuple[float, ...] = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
    3600.0,
    7200.0,
    14400.0,
    43200.0,
    86400.0,
)
"""Histogram upper bounds: 1 ms to 1 day (residency and eviction age)."""

TOTAL_KEYS = ("evicted", "batches", "near", "failures", "errors", "dropped")
MAX_PIDS_PER_ENGINE = 8


@dataclass
class Histogram:
    """Cumulative-ready bucket counts, sum and count."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(BUCKETS) + 1))
    total: float = 0.0

    def observe(self, value: float) -> None:
        self.observe_many((value,))

    def observe_many(self, values: Iterable[float]) -> None:
        counts = self.counts
        for value in values:
            counts[bisect.bisect_left(BUCKETS, value)] += 1
            self.total += value

    def buckets(self) -> list[tuple[str, int]]:
        """(le, cumulative count) pairs, ending with +Inf."""
        out, running = [], 0
        for bound, count in zip((*BUCKETS, float("inf")), self.counts, strict=True):
            running += count
            out.append(("+Inf" if bound == float("inf") else repr(bound), running))
        return out


def _add(into: dict[str, dict[str, float]], totals: Mapping[str, Any]) -> None:
    for name in TOTAL_KEYS:
        target = into.setdefault(name, {})
        for label, value in (totals.get(name) or {}).items():
            target[label] = target.get(label, 0) + value


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and value == value


def _well_typed(record: Mapping[str, Any]) -> bool:
    """The fields the sidecar folds have the types kvobs writes."""
    if record.get("t") is not None and not _number(record["t"]):
        return False
    if record.get("pid") is not None and not isinstance(record["pid"], int):
        return False
    if record.get("run") is not None and not isinstance(record["run"], str):
        return False
    kind = record.get("k")
    if kind == "totals":
        for name in TOTAL_KEYS:
            counts = record.get(name)
            if counts is None:
                continue
            if not isinstance(counts, dict) or not all(
                isinstance(k, str) and _number(v) for k, v in counts.items()
            ):
                return False
        return all(record.get(k) is None or _number(record[k]) for k in ("hist_keys", "hist_window"))
    if kind == "batch":
        res, groups = record.get("res"), record.get("g")
        return (res is None or (isinstance(res, list) and all(_number(a) for a in res))) and (
            groups is None or isinstance(groups, dict)
        )
    return True


def _summary(raw: Any) -> tuple[list[tuple[str, str, int]], dict[str, tuple[list[int], float]]] | None:
    """A report's ``missing_summary`` (counts by cause and group, bucketed ages), or None if ill-typed."""
    if not isinstance(raw, dict) or not isinstance(raw.get("counts"), list) or not isinstance(raw.get("ages"), dict):
        return None
    counts: list[tuple[str, str, int]] = []
    for row in raw["counts"]:
        if not (isinstance(row, list) and len(row) == 3 and isinstance(row[0], str) and isinstance(row[2], int)
                and not isinstance(row[2], bool) and row[2] >= 0):
            return None
        counts.append((row[0], str(row[1]), row[2]))
    ages: dict[str, tuple[list[int], float]] = {}
    for group, hist in raw["ages"].items():
        buckets = hist.get("counts") if isinstance(hist, dict) else None
        total = hist.get("sum") if isinstance(hist, dict) else None
        if not (isinstance(buckets, list) and len(buckets) == len(BUCKETS) + 1 and isinstance(total, int | float)
                and _number(total) and all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in buckets)):
            return None
        ages[str(group)] = (buckets, float(total))
    return counts, ages


@dataclass
class EngineState:
    """One ``engine`` label: possibly several processes over time (restarts)."""

    live: dict[str, dict[str, Any]] = field(default_factory=dict)  # writer ("pid/run") -> latest totals
    retired: dict[str, dict[str, float]] = field(default_factory=dict)  # totals of pruned writers
    hello: dict[str, Any] = field(default_factory=dict)
    last_record_time: float = 0.0
    groups: set[str] = field(default_factory=set)
    residency: dict[str, Histogram] = field(default_factory=dict)
    missing: dict[tuple[str, str], int] = field(default_factory=dict)  # (cause, group)
    missing_age: dict[str, Histogram] = field(default_factory=dict)  # group

    def totals(self) -> dict[str, dict[str, float]]:
        summed: dict[str, dict[str, float]] = {k: dict(v) for k, v in self.retired.items()}
        for totals in self.live.values():
            _add(summed, totals)
        return summed

    def latest(self) -> dict[str, Any]:
        return max(self.live.values(), key=lambda t: t.get("t", 0.0), default={})


class SidecarState:
    """Folds records; ``snapshot`` is read by the metrics collector."""

    def __init__(self) -> None:
        self.engines: dict[str, EngineState] = {}
        self.positions: dict[str, int] = {}
        self.reports_seen: set[str] = set()
        self.records = 0
        self.corrupt = 0

    def engine(self, name: str) -> EngineState:
        state = self.engines.get(name)
        if state is None:
            state = self.engines[name] = EngineState()
        return state

    def apply(self, record: dict[str, Any] | None) -> None:
        """Fold one journal record (None, or fields of the wrong type: a corrupt line, counted).

        Checked before anything is folded, so a bad line changes nothing but the
        corrupt count (an ill-typed totals record would otherwise break every scrape).
        """
        if record is None or not isinstance(record.get("e"), str) or not _well_typed(record):
            self.corrupt += 1
            return
        self.records += 1
        state = self.engine(record["e"])
        state.last_record_time = max(state.last_record_time, float(record.get("t") or 0.0))
        kind = record.get("k")
        if kind == "batch":
            reason = record.get("r")
            if reason in REASONS:
                hist = state.residency.get(reason)
                if hist is None:
                    hist = state.residency[reason] = Histogram()
                hist.observe_many(float(a) for a in record.get("res") or ())
            state.groups.update(str(g) for g in (record.get("g") or {}))
        elif kind == "totals":
            # One writer's cumulative totals; a writer is a pid and, since journals carry it, the
            # JournalSink's run (a restarted container reuses pids; its totals start from zero).
            writer = str(int(record.get("pid") or 0))
            if record.get("run") is not None:
                writer += f"/{record['run']}"
            state.live[writer] = {k: record.get(k) for k in (*TOTAL_KEYS, "t", "hist_keys", "hist_window")}
            if len(state.live) > MAX_PIDS_PER_ENGINE:
                oldest = min(state.live, key=lambda p: state.live[p].get("t", 0.0))
                _add(state.retired, state.live.pop(oldest))
        elif kind == "hello":
            state.hello = {k: record.get(k) for k in ("version", "vllm_version", "history_size", "pid")}

    def apply_report(self, name: str, report: dict[str, Any]) -> None:
        """Fold one failure report (each file once)."""
        if name in self.reports_seen:
            return
        self.reports_seen.add(name)
        engine = report.get("engine")
        if not isinstance(engine, str):
            self.corrupt += 1
            return
        missing = report.get("missing") or ()
        if not isinstance(missing, list) or not all(
            isinstance(k, dict) and (k.get("seconds_since_eviction") is None or _number(k["seconds_since_eviction"]))
            for k in missing
        ):
            self.corrupt += 1
            return
        if "missing_summary" in report:  # every key, aggregated (the list may be cut)
            summary = _summary(report["missing_summary"])
            if summary is None:
                self.corrupt += 1
                return
            self._apply_summary(self.engine(engine), *summary)
            return
        state = self.engine(engine)
        for key in missing:
            group = str(key.get("group"))
            cause = key.get("cause")
            if cause not in CAUSES:
                continue
            state.groups.add(group)
            state.missing[(cause, group)] = state.missing.get((cause, group), 0) + 1
            age = key.get("seconds_since_eviction")
            if age is not None:
                hist = state.missing_age.get(group)
                if hist is None:
                    hist = state.missing_age[group] = Histogram()
                hist.observe(float(age))

    @staticmethod
    def _apply_summary(
        state: EngineState, counts: list[tuple[str, str, int]], ages: dict[str, tuple[list[int], float]]
    ) -> None:
        for cause, group, n in counts:
            if cause in CAUSES:
                state.groups.add(group)
                state.missing[(cause, group)] = state.missing.get((cause, group), 0) + n
        for group, (buckets, total) in ages.items():
            hist = state.missing_age.get(group)
            if hist is None:
                hist = state.missing_age[group] = Histogram()
            hist.counts = [have + more for have, more in zip(hist.counts, buckets, strict=True)]
            hist.total += total

    # -- checkpoint -------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        def hist(h: Histogram) -> dict[str, Any]:
            return {"counts": h.counts, "total": h.total}

        return {
            "format": 1,
            "saved_at": time.time(),
            "positions": self.positions,
            "reports_seen": sorted(self.reports_seen),
            "records": self.records,
            "corrupt": self.corrupt,
            "engines": {
                name: {
                    "live": dict(e.live),
                    "retired": e.retired,
                    "hello": e.hello,
                    "last_record_time": e.last_record_time,
                    "groups": sorted(e.groups),
                    "residency": {r: hist(h) for r, h in e.residency.items()},
                    "missing": [[c, g, n] for (c, g), n in e.missing.items()],
                    "missing_age": {g: hist(h) for g, h in e.missing_age.items()},
                }
                for name, e in self.engines.items()
            },
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SidecarState:
        def hist(d: dict[str, Any]) -> Histogram:
            return Histogram(counts=list(d["counts"]), total=float(d["total"]))

        state = cls()
        state.positions = {str(k): int(v) for k, v in data["positions"].items()}
        state.reports_seen = set(data["reports_seen"])
        state.records = int(data["records"])
        state.corrupt = int(data["corrupt"])
        for name, e in data["engines"].items():
            engine = state.engine(name)
            engine.live = {str(writer): t for writer, t in e["live"].items()}
            engine.retired = e["retired"]
            engine.hello = e["hello"]
            engine.last_record_time = float(e["last_record_time"])
            engine.groups = set(e["groups"])
            engine.residency = {r: hist(h) for r, h in e["residency"].items()}
            engine.missing = {(c, g): int(n) for c, g, n in e["missing"]}
            engine.missing_age = {g: hist(h) for g, h in e["missing_age"].items()}
        return state


def load_checkpoint(path: Path) -> SidecarState | None:
    """The saved state, or None if there is none or it cannot be read (counted by the caller)."""
    try:
        return SidecarState.from_json(json.loads(path.read_text()))
    except FileNotFoundError:
        return None
