"""GET /api/v1/failures: which report files a page reads, and each report as the API serves it.

Apart from the HTTP server (kvobs/sidecar/server.py), which routes the request here: a page reads the report
files one at a time, within ``MAX_SCANNED`` files and ``MAX_PAGE_BYTES``, skips what does not read (the sidecar's
metrics count it), and hands out the ``next`` URL a client asks again with. The parameters' rules are
kvobs/sidecar/query.py's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

from kvobs.codes import BUCKETS
from kvobs.sidecar.query import DEFAULT_FAILURES, FAILURES_PATH, parse_params
from kvobs.wire.decode import Report, read_report, report_files
from kvobs.wire.format import REPORT_ID, REPORT_SUFFIX, report_time_ms

MAX_SCANNED = 5_000
"""Report files one /api/v1/failures request reads at most; then it answers with what matched and a ``next``."""
MAX_PAGE_BYTES = 64 * 2**20
"""Report bytes (as on disk) one page holds at most; it always holds at least one report."""
AGE_BOUNDS: list[float | str] = [*BUCKETS, "+Inf"]
"""The upper bounds of a ``missing_summary.ages`` histogram's ``counts``, one per count."""


@dataclass(frozen=True)
class FailureQuery:
    """The filters and the page of a /api/v1/failures request."""

    limit: int = DEFAULT_FAILURES
    engines: frozenset[str] | None = None
    models: frozenset[str] | None = None
    causes: frozenset[str] | None = None
    since: float | None = None
    before: str | None = None

    @classmethod
    def parse(cls, query: str) -> FailureQuery:
        """The query string's filters, each parameter by its rule (``kvobs.sidecar.query``); a
        :class:`QueryError` naming the parameter that does not fit."""
        params = parse_params(query)

        def one(name: str) -> Any:
            return params[name][0] if name in params else None

        def any_of(name: str) -> frozenset[Any] | None:
            return frozenset(params[name]) if name in params else None

        return cls(one("limit") or DEFAULT_FAILURES, any_of("engine"), any_of("model_name"), any_of("cause"),
                   one("since"), one("before"))

    def matches(self, report: Report) -> bool:
        return ((self.engines is None or report.engine in self.engines)
                and (self.models is None or report.model_name in self.models)
                and (self.causes is None or report.cause in self.causes)
                and (self.since is None or report.time >= self.since))

    def skips_by_name(self, report_id: str) -> bool:
        """True if the id alone shows the report is not on this page (not older than ``before``, or a
        file name's millisecond time well before ``since``): no need to read it."""
        if self.before is not None and report_id >= self.before:
            return True
        if self.since is not None:
            timed = report_time_ms(report_id)  # a report's file name starts with its millisecond wall time
            if timed is not None and timed + 2 < self.since * 1000:
                return True
        return False

    def next_url(self, before: str) -> str:
        """The relative URL of the page after the one that ended at report ``before``."""
        params: list[tuple[str, Any]] = [("limit", self.limit)]
        for name, values in (("engine", self.engines), ("model_name", self.models), ("cause", self.causes)):
            params.extend((name, value) for value in sorted(values or ()))
        if self.since is not None:
            params.append(("since", repr(self.since)))
        params.append(("before", before))
        return FAILURES_PATH + "?" + urlencode(params)


def _report_ids(failures_dir: Path) -> list[tuple[str, Path]]:
    """(id, path) of the report files, newest first (ids sort in write order; one order for ``before``)."""
    return [(path.stem, path) for path in report_files(failures_dir)]


def served_report(report: Report, report_id: str) -> dict[str, Any]:
    """A report as served: the file's fields, its ``id``, and each age histogram's ``bounds`` next to its
    ``counts`` (a report from before ``missing_summary`` gets one, summed from its listed keys)."""
    summary = report.data.get("missing_summary")
    if not isinstance(summary, dict):
        summary = {"counts": [[cause, int(group), n] for cause, group, n in report.summary.counts],
                   "ages": {group: hist.to_json() for group, hist in report.summary.ages.items()}}
    ages = summary.get("ages")
    if isinstance(ages, dict):  # validated by read_report: len(counts) == len(AGE_BOUNDS)
        ages = {group: {**hist, "bounds": AGE_BOUNDS} if isinstance(hist, dict) else hist
                for group, hist in ages.items()}
    return {**report.data, "missing_summary": {**summary, "bounds": summary.get("bounds", list(BUCKETS)),
                                               "ages": ages},
            "id": report_id}


def failure_page(failures_dir: Path, query: FailureQuery) -> tuple[list[dict[str, Any]], str | None]:
    """The reports on this page, newest first, and the id the next page starts before (None: no more match).

    Reads one report file at a time, at most ``MAX_SCANNED`` of them and ``MAX_PAGE_BYTES`` for the
    page; unreadable or damaged files are skipped (the sidecar counts them in its metrics)."""
    page: list[dict[str, Any]] = []
    size = scanned = 0
    last_read: str | None = None
    for report_id, path in _report_ids(failures_dir):
        if query.skips_by_name(report_id):
            continue
        if scanned >= MAX_SCANNED:  # this request's budget is spent: the client asks again from here
            return page, (page[-1]["id"] if len(page) == query.limit else last_read)
        scanned += 1
        last_read = report_id
        try:
            file_size = path.lstat().st_size
            report = read_report(path)
        except (OSError, ValueError):
            continue
        if not query.matches(report):
            continue
        if len(page) == query.limit:  # one more matches: there is a next page
            return page, page[-1]["id"]
        if page and size + file_size > MAX_PAGE_BYTES:
            return page, page[-1]["id"]
        page.append(served_report(report, report_id))
        size += file_size
    return page, None


def one_report(failures_dir: Path, report_id: str) -> dict[str, Any] | None:
    """The report ``report_id`` as /api/v1/failures serves it, or None when there is no such readable
    report (an id kvobs does not write, a name that is not one, a file gone or damaged)."""
    if not REPORT_ID.fullmatch(report_id):
        return None
    try:
        return served_report(read_report(failures_dir / (report_id + REPORT_SUFFIX)), report_id)
    except (OSError, ValueError):
        return None
