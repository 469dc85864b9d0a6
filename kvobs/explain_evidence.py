"""What kvobs recorded about the assertions ``kvobs explain`` found in a log: the failure reports and the latest
journaled removals of each key, read from a kvobs directory or a running sidecar's API (bounded: bytes,
pages, time). Pure file and HTTP reading; never imports vLLM."""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvobs import explain_tracebacks
from kvobs.explain import REMOVALS_SHOWN, ExplainError, LoggedAssertion
from kvobs.sidecar.query import FAILURES_PATH
from kvobs.wire.decode import JournalPosition, iter_reports, list_reports, read_records
from kvobs.wire.format import (
    FAILURES_DIR,
    JOURNAL_DIR,
    JOURNAL_SUFFIX,
    MAX_REPORT_BYTES,
    Removals,
    fit_req_id,
    load_json,
    ref_from_text,
)

MAX_JOURNAL_BYTES = 2 << 30
"""Journal bytes scanned for removals (kvobs keeps at most 64 MiB per engine process)."""
SIDECAR_PAGE_REPORTS = 1_000
MAX_SIDECAR_PAGE_BYTES = 64 * MAX_REPORT_BYTES
"""The most of one page that is read (a page of SIDECAR_PAGE_REPORTS reports, each cut to far less
than MAX_REPORT_BYTES by its writer, is smaller): a larger answer is said to be too large."""
MAX_SIDECAR_PAGES = 100
"""Pages of the sidecar's reports read at most (100,000 reports); then explain says where it stopped."""
SIDECAR_DEADLINE_S = 120.0
"""Time spent reading the sidecar's pages at most (each request has a 10 s timeout of its own)."""


def _report_matches(report: dict[str, Any], entry: LoggedAssertion) -> bool:
    """The report is of this assertion's key, and of its request and cause when kvobs's message in the
    log names them (another failure on the same key is another assertion's)."""
    if entry.kvobs_req_id is not None and report.get("req_id") != fit_req_id(entry.kvobs_req_id):
        return False
    if entry.kvobs_cause is not None and report.get("cause") != entry.kvobs_cause:
        return False
    if report.get("vllm_message") == entry.vllm_text:
        return True
    ref = entry.key_ref
    missing = report.get("missing")
    return ref is not None and isinstance(missing, list) and any(
        isinstance(m, dict) and m.get("key") == ref for m in missing
    )


def add_directory_evidence(entries: list[LoggedAssertion], directory: Path,
                           exceptions: list[explain_tracebacks.LoggedException] | None = None) -> list[str]:
    """Failure reports and journaled removals in a kvobs directory, for each logged key (and the reports of
    each logged exception's site); returns a note naming the files in ``failures/`` that are not kvobs
    reports (skipped, as the sidecar skips them)."""
    if not directory.is_dir():
        raise ExplainError(f"--dir {directory}: not a directory (expected the KVOBS_DIR the engines wrote)")
    strays = list_reports(directory / FAILURES_DIR)[1]
    notes = [f"{len(strays)} *.json file(s) in {directory / FAILURES_DIR} not named as kvobs names reports, "
             f"skipped: {', '.join(p.name for p in strays[:5])}{' ...' if len(strays) > 5 else ''}"] if strays else []
    for report in iter_reports(directory / FAILURES_DIR):
        for entry in entries:
            if _report_matches(report, entry):
                entry.reports.append(report)
        explain_tracebacks.attach((report,), exceptions or [])
    wanted: dict[str, list[LoggedAssertion]] = {}
    for entry in entries:
        ref = entry.key_ref
        if ref is not None:
            wanted.setdefault(ref, []).append(entry)
    if wanted:
        for removal in _journal_removals(directory / JOURNAL_DIR, set(wanted)):
            for entry in wanted[removal["key"]]:
                # Its reports name kvobs's engine: another engine's removals of the key are not its.
                if not entry.reports or removal["engine"] in {report.get("engine") for report in entry.reports}:
                    entry.removals.append(removal)
        for entry in entries:
            entry.removals.sort(key=lambda r: r["time"] or 0.0, reverse=True)
            del entry.removals[REMOVALS_SHOWN:]
    return notes


def _journal_removals(journal_dir: Path, refs: set[str]) -> Iterator[dict[str, Any]]:
    """Removals of any of ``refs`` in the journals (keys beyond the first ones listed per batch
    are counted there, not named), read by the sidecar's decoder (``kvobs.wire.decode``): a line is
    a removals record by its fields, whatever the order of its keys."""
    if not journal_dir.is_dir():
        return
    wanted = {ref_bytes: ref for ref in refs if (ref_bytes := ref_from_text(ref)) is not None}
    budget = MAX_JOURNAL_BYTES
    for path in sorted(journal_dir.glob("*" + JOURNAL_SUFFIX)):
        position = JournalPosition()
        try:
            for record in read_records(path, position, budget):
                if isinstance(record, Removals):
                    yield from _removals_in(record, wanted)
        except OSError:
            continue
        finally:
            budget -= position.offset
        if budget <= 0:
            return


def _removals_in(record: Removals, wanted: dict[bytes, str]) -> Iterator[dict[str, Any]]:
    for serial, when, reason, path, req_id, count, listed, ages in record.batches():
        seen: set[bytes] = set()
        for ref, age in zip(listed, ages, strict=True):
            if ref in wanted and ref not in seen:  # one removal per batch, per key
                seen.add(ref)
                yield {
                    "key": wanted[ref],
                    "engine": record.writer.engine,
                    "pid": record.writer.pid,
                    "serial": serial,
                    "time": when,
                    "reason": reason,
                    "path": path,
                    "req_id": req_id,
                    "batch_keys": count,
                    "residency_s": None if age != age else round(age, 6),
                }


class _PageFailed(Exception):
    """One page of the sidecar's reports could not be read; the message says which and why."""


def add_sidecar_evidence(entries: list[LoggedAssertion], url: str, token: bytes | None = None,
                         exceptions: list[explain_tracebacks.LoggedException] | None = None) -> list[str]:
    """Failure reports from a running sidecar's /api/v1/failures, every page (the API's ``next``)
    until it is null, at most ``MAX_SIDECAR_PAGES`` pages and ``SIDECAR_DEADLINE_S``; the notes
    returned say where it stopped when it did not read them all. A first page that fails is an
    :class:`ExplainError`; a later one stops the paging, keeping what the earlier pages matched.
    ``token``: the bearer token a sidecar run with ``--token-file`` requires (sent as
    ``Authorization: Bearer``); a refused one is an :class:`ExplainError` on any page."""
    base = url.rstrip("/")
    if not base.startswith(("http://", "https://")):
        raise ExplainError(f"--sidecar {url}: expected an http:// or https:// URL")
    page: str | None = f"{FAILURES_PATH}?limit={SIDECAR_PAGE_REPORTS}"
    deadline = time.monotonic() + SIDECAR_DEADLINE_S
    pages = read = 0
    while page is not None:
        if pages >= MAX_SIDECAR_PAGES or time.monotonic() > deadline:
            bound = f"{MAX_SIDECAR_PAGES} pages" if pages >= MAX_SIDECAR_PAGES else f"{SIDECAR_DEADLINE_S:.0f} s"
            return [_stopped(pages, read, f"the bound is {bound}", base + page)]
        try:
            reports, following = _sidecar_page(base + page, url, token)
        except _PageFailed as exc:
            if pages == 0:
                raise ExplainError(f"--sidecar {url}: {exc}") from exc.__cause__
            return [_stopped(pages, read, str(exc), base + page)]
        page = following
        pages += 1
        read += len(reports)
        for report in reports:
            if isinstance(report, dict):
                for entry in entries:
                    if _report_matches(report, entry) and report not in entry.reports:
                        entry.reports.append(report)
        explain_tracebacks.attach(reports, exceptions or [])
    return []


def _stopped(pages: int, read: int, why: str, endpoint: str) -> str:
    return (f"--sidecar: stopped after {pages} page{'s' * (pages != 1)} ({read} reports): {why}; older reports "
            f"were not read (next: {endpoint[:300]}); narrow with --dir or read the API")


def _sidecar_page(endpoint: str, url: str, token: bytes | None) -> tuple[list[Any], str | None]:
    """One page of reports and the relative URL of the next (None: the last page)."""
    headers = {} if token is None else {"Authorization": "Bearer " + token.decode("ascii")}
    try:
        with urllib.request.urlopen(urllib.request.Request(endpoint, headers=headers), timeout=10) as response:
            body = response.read(MAX_SIDECAR_PAGE_BYTES + 1)
    except urllib.error.HTTPError as exc:
        if exc.code == 401:
            given = "the token of --token-file was refused" if token else "it requires a bearer token"
            raise ExplainError(f"--sidecar {url}: {endpoint} answered 401: {given} (give the file the sidecar's "
                               "--token-file reads: --token-file PATH)") from exc
        raise _PageFailed(f"cannot read {endpoint}: {exc}") from exc
    except (OSError, urllib.error.URLError) as exc:
        raise _PageFailed(f"cannot read {endpoint}: {exc}") from exc
    if len(body) > MAX_SIDECAR_PAGE_BYTES:
        raise _PageFailed(f"{endpoint} answered more than {MAX_SIDECAR_PAGE_BYTES} bytes, too large for one page "
                          f"(of at most {SIDECAR_PAGE_REPORTS} reports)")
    try:
        data, _ = load_json(body)  # an older sidecar may serve a report's lone surrogate as its escape
        reports, following = data["failures"], data.get("next")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        raise _PageFailed(f"{endpoint} did not answer with kvobs failure reports") from exc
    if following is not None and not (isinstance(following, str) and following.startswith(FAILURES_PATH + "?")):
        raise _PageFailed(f"{endpoint} answered a next page that is not the API's: {str(following)[:200]!r}")
    return (reports if isinstance(reports, list) else []), following
