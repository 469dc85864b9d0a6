"""The sidecar's replay endpoints: ask the engines for bundles, list them, hand one out.

``POST /api/v1/replays`` (``?engine=E``: only that engine; default every engine of the directory) leaves a
request the engines' journal writers answer within a second or two (kvobs/replay_requests.py): 202 with the
request's id and the engines expected to answer; 429 (``Retry-After``) within ``REQUEST_EVERY_S`` of the
last request; 400 for a parameter it does not know or an engine that is not a label. A request no engine
can answer is refused rather than left to expire unseen (:func:`answerable`): 404 for an engine this
directory has no journal of (``reason`` "unknown"), 409 for one whose writers are all dead (``reason``
"not_alive": no process holds its journal files) or that runs unobserved (``reason`` "unobserved"), and
409 for a request to every engine when none is alive (``reason`` "no_live_engine").

``GET /api/v1/replays``: the bundles in ``<dir>/replay/`` and ``<dir>/replay/requested/``
(kvobs.bundles.BUNDLE_FOLDERS), newest first, each with what its header says (engine, failure or the
request it answers, whether it holds a window to replay and, if not, why); the requests ``pending``; and
``requests``, the newest ``MAX_TRACKED_REQUESTS`` with their ``state``: pending, answered (every engine
expected has written its bundle) or unanswered (``REQUEST_TTL_S`` passed first; ``reason`` says which
engine did not answer). The sidecar logs one line for each unanswered request (:class:`Tracker`).
``GET /api/v1/replays/<id>``: the bundle's file (``application/zip``), for ``kvobs replay``.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from kvobs.bundles import BUNDLE_DIR, BUNDLE_FOLDERS, BUNDLE_SUFFIX, REQUESTED_DIR, bundle_files, read_header
from kvobs.files import held
from kvobs.replay_requests import POLL_EVERY_S, REQUEST_TTL_S, Request, make_request, pending
from kvobs.sidecar.ingest import Ingest, list_journals
from kvobs.wire.format import JOURNAL_DIR, REPORT_ID, is_engine_label, parse_stem

logger = logging.getLogger("kvobs.sidecar")

REPLAYS_PATH = "/api/v1/replays"
MAX_TRACKED_REQUESTS = 32
"""Requests ``GET /api/v1/replays`` lists in ``requests`` (the sidecar remembers no more; one per
``REQUEST_EVERY_S`` living ``REQUEST_TTL_S`` makes at most 7 pending at once)."""
LIVE_RECORD_S = 10.0
"""Where the file system cannot tell a live writer by its lock (kvobs.files.held), an engine whose last
journal record is younger than this is taken as alive (a live writer writes its totals every flush)."""
UNANSWERED_EVENT = "kvobs.replay_request_unanswered"
"""The ``event`` of the line the sidecar logs for a request no engine answered within ``REQUEST_TTL_S``."""


class RequestError(ValueError):
    """A bad ``POST /api/v1/replays``: ``parameter`` names what is wrong."""

    def __init__(self, message: str, parameter: str) -> None:
        super().__init__(message)
        self.parameter = parameter


class Refused(Exception):
    """No engine can answer the request: ``status`` 404 (an engine this directory never had) or 409 (dead,
    unobserved, or no engine alive at all); ``reason`` is the machine-readable why, the message the human one."""

    def __init__(self, status: int, engine: str | None, reason: str, message: str) -> None:
        super().__init__(message)
        self.status, self.engine, self.reason = status, engine, reason


@dataclass(frozen=True)
class EngineLife:
    """What the sidecar knows of one engine label: whether a live process holds one of its journal files (None:
    the file system cannot tell), its last record's time (0: none read) and whether it runs observed."""

    held: bool | None
    last_record: float
    observing: bool | None


def engine_lives(ingest: Ingest) -> dict[str, EngineLife]:
    """Each engine label with a journal file in the directory or records read by the sidecar. A journal
    writer holds a shared ``flock`` on its open file that only its death (or close) releases
    (kvobs.files.hold): the one sure sign the writer that would answer a request lives."""
    holds: dict[str, bool | None] = {}
    try:
        journals = list_journals(ingest.dir / JOURNAL_DIR)
    except OSError:
        journals = []
    for journal in journals:
        parsed = parse_stem(journal.stem)
        if parsed is None or journal.rotated or holds.get(parsed[0]) is True:
            continue
        engine, probe = parsed[0], held(journal.path)
        if probe or engine not in holds or (probe is None and holds[engine] is False):  # True > None > False
            holds[engine] = probe
    last: dict[str, float] = {}
    observing: dict[str, bool] = {}
    with ingest.lock:
        for (_, engine), state in ingest.state.engines.items():
            last[engine] = max(last.get(engine, 0.0), state.last_record_time)
            if state.hello is not None:
                observing[engine] = observing.get(engine, False) or state.hello.observing
    return {engine: EngineLife(holds.get(engine, False), last.get(engine, 0.0), observing.get(engine))
            for engine in holds.keys() | last.keys()}


def _why_not(life: EngineLife, now: float) -> tuple[str, str] | None:
    """(reason, words) when an engine known to the directory cannot answer; None when it can."""
    alive = life.held is True or (life.held is None and now - life.last_record < LIVE_RECORD_S)
    if not alive:
        since = f"; its last record is {now - life.last_record:.0f} s old" if life.last_record else ""
        return "not_alive", f"no live process writes its journal (the engine died or stopped){since}"
    if life.observing is False:
        return "unobserved", "it runs unobserved (kvobs_observing 0): it has no journal writer to answer"
    return None


def answerable(ingest: Ingest, engine: str | None, now: float | None = None) -> tuple[str, ...]:
    """The engines that would answer a request for ``engine`` (None: every engine), sorted; :class:`Refused`
    when none would. So a request nobody can answer is refused at once, not accepted and lost after a minute."""
    now = time.time() if now is None else now
    lives = engine_lives(ingest)
    if engine is None:
        live = tuple(sorted(e for e, life in lives.items() if _why_not(life, now) is None))
        if not live:
            known = ", ".join(sorted(lives)[:10]) or "none"
            raise Refused(409, None, "no_live_engine", f"no engine writing to this directory is alive to answer "
                                                       f"(engines with a journal here: {known})")
        return live
    life = lives.get(engine)
    if life is None:
        raise Refused(404, engine, "unknown", f"engine {engine!r}: this directory has no journal of it "
                                              "(GET /metrics lists the engines)")
    why = _why_not(life, now)
    if why is not None:
        raise Refused(409, engine, why[0], f"engine {engine!r}: {why[1]}")
    return (engine,)


def request(directory: Path, query: str, tracker: Tracker | None = None) -> dict[str, Any]:
    """Leave a request for bundles (kvobs.replay_requests.TooSoon when too soon, :class:`RequestError` when
    the query is bad, :class:`Refused` when no engine would answer it): what the 202 says. ``tracker``: the
    sidecar's, which checks the engine and follows the request to its answer."""
    params = parse_qs(query, keep_blank_values=True)
    for name in params:
        if name != "engine":
            raise RequestError(f"unknown parameter {name[:100]!r} (this endpoint takes only 'engine')", name[:100])
    engines = params.get("engine", [])
    if len(engines) > 1:
        raise RequestError("'engine' may be given once (leave it out to ask every engine)", "engine")
    engine = engines[0] if engines else None
    if engine is not None and not is_engine_label(engine):
        raise RequestError(f"not an engine label: {engine!r:.100}", "engine")
    expected = answerable(tracker.ingest, engine) if tracker is not None else ()
    made = make_request(directory, engine)
    if tracker is not None:
        tracker.track(made, expected)
    return {"request": made.id, "engine": made.engine, "bundles": REPLAYS_PATH, "expected": list(expected),
            "note": "each engine expected answers within seconds with a bundle whose 'requested' is this id; "
                    f"'requests' in {REPLAYS_PATH} says whether it did"}


def listing(directory: Path, tracker: Tracker | None = None) -> dict[str, Any]:
    """The bundles, newest first, with what their headers say, the requests pending, and (``tracker``) the
    newest requests with their state."""
    bundles = []
    paths = [path for folder in BUNDLE_FOLDERS for path in bundle_files(directory / folder)]
    for path in sorted(paths, key=lambda p: p.name, reverse=True):
        bundle_id = path.name[: -len(BUNDLE_SUFFIX)]
        try:
            size = path.stat().st_size
            header = read_header(str(path))
        except (OSError, ValueError, zlib.error):  # gone since the listing, or damaged (a corrupt deflate
            continue  # stream is zlib.error, not ValueError: tests/fuzz/crashes/bundle/): left out
        window = header.get("window")
        window = window if isinstance(window, dict) else {}
        failure = header.get("failure")
        failure = failure if isinstance(failure, dict) else None
        bundles.append({
            "id": bundle_id, "url": f"{REPLAYS_PATH}/{bundle_id}", "bytes": size,
            "created": header.get("created"), "engine": header.get("engine"),
            "vllm_version": header.get("vllm_version"), "requested": header.get("requested"),
            "failure": None if failure is None else {k: failure.get(k) for k in ("cause", "req_id", "recomputed")},
            "replayable": window.get("replayable"), "calls": window.get("calls"), "why_not": window.get("why_not"),
        })
    out: dict[str, Any] = {"bundles": bundles, "pending": [{"request": r.id, "engine": r.engine, "created": r.created}
                                                       for r in pending(directory)]}
    if tracker is not None:
        tracker.sweep()
        out["requests"] = tracker.served()
    return out


def bundle_path(directory: Path, bundle_id: str) -> Path | None:
    """The file of bundle ``bundle_id``, None when there is no such bundle (or the id is not one)."""
    if not REPORT_ID.fullmatch(bundle_id):
        return None
    for folder in BUNDLE_FOLDERS:
        path = directory / folder / f"{bundle_id}{BUNDLE_SUFFIX}"
        if os.path.isfile(path) and not os.path.islink(path):
            return path
    return None


@dataclass
class Tracked:
    """A request the sidecar follows: the engines expected to answer, those that did, and its state."""

    request: Request
    expected: tuple[str, ...]
    answered_by: set[str] = field(default_factory=set)
    state: str = "pending"
    """pending, answered, or unanswered (``REQUEST_TTL_S`` passed before every expected engine answered)."""
    reason: str | None = None

    def served(self) -> dict[str, Any]:
        return {"request": self.request.id, "engine": self.request.engine, "created": self.request.created,
                "expected": list(self.expected), "answered_by": sorted(self.answered_by), "state": self.state,
                "reason": self.reason}


class Tracker:
    """Follows each request to its answer (a bundle whose header's ``requested`` is its id), so one no engine
    answers within ``REQUEST_TTL_S`` is said, in ``GET /api/v1/replays`` and in one log line, instead of
    vanishing with its file. Requests left by another (an earlier sidecar, kvobs.replay_requests.make_request
    called directly) are adopted when seen. In memory, the newest ``MAX_TRACKED_REQUESTS``."""

    def __init__(self, ingest: Ingest) -> None:
        self.ingest = ingest
        self.lock = threading.Lock()
        self.tracked: dict[str, Tracked] = {}
        self._headers: dict[str, tuple[str | None, str | None]] = {}
        """Requested bundle file name -> (the request it answers, its engine): each header read once."""

    def track(self, request: Request, expected: Iterable[str]) -> None:
        with self.lock:
            self._add(Tracked(request, tuple(expected)))

    def _add(self, tracked: Tracked) -> None:
        self.tracked[tracked.request.id] = tracked
        while len(self.tracked) > MAX_TRACKED_REQUESTS:  # the oldest settled first, else the oldest
            settled = [t for t in self.tracked.values() if t.state != "pending"] or list(self.tracked.values())
            del self.tracked[min(settled, key=lambda t: t.request.created).request.id]

    def _answers(self) -> dict[str, set[str]]:
        """Request id -> engines whose bundle in ``<dir>/replay/requested/`` answers it."""
        paths = bundle_files(self.ingest.dir / BUNDLE_DIR / REQUESTED_DIR)
        names = {path.name for path in paths}
        self._headers = {name: seen for name, seen in self._headers.items() if name in names}  # bounded
        answers: dict[str, set[str]] = {}
        for path in paths:
            if path.name not in self._headers:
                try:
                    header = read_header(str(path))
                except (OSError, ValueError, zlib.error):
                    continue  # being written, or damaged: looked at again next sweep
                requested, engine = header.get("requested"), header.get("engine")
                self._headers[path.name] = (requested if isinstance(requested, str) else None,
                                            engine if isinstance(engine, str) else None)
            requested, engine = self._headers[path.name]
            if requested is not None and engine is not None:
                answers.setdefault(requested, set()).add(engine)
        return answers

    def sweep(self, now: float | None = None) -> None:
        """Adopt requests seen in the directory, mark those answered, and those past ``REQUEST_TTL_S``
        unanswered (logging each once)."""
        now = time.time() if now is None else now
        with self.lock:
            for request in pending(self.ingest.dir, now):
                if request.id not in self.tracked:
                    try:
                        expected = answerable(self.ingest, request.engine, now)
                    except Refused:
                        expected = (request.engine,) if request.engine else ()
                    self._add(Tracked(request, expected))
            open_ = [t for t in self.tracked.values() if t.state == "pending"]
            if not open_:
                return
            answers = self._answers()
            for tracked in open_:
                tracked.answered_by |= answers.get(tracked.request.id, set())
                missing = sorted(set(tracked.expected) - tracked.answered_by)
                if tracked.answered_by and not missing:
                    tracked.state = "answered"
                elif now - tracked.request.created >= REQUEST_TTL_S:
                    self._unanswered(tracked, missing)

    def _unanswered(self, tracked: Tracked, missing: list[str]) -> None:
        tracked.state = "unanswered"
        who = ", ".join(missing) or "any engine"
        got = f"; answered by {', '.join(sorted(tracked.answered_by))}" if tracked.answered_by else ""
        tracked.reason = (f"no bundle from {who} within {REQUEST_TTL_S:g} s (the engine died or stopped, or its "
                          f"journal writer is stalled){got}")
        logger.warning("kvobs sidecar: replay request %s (engine %s) unanswered: %s", tracked.request.id,
                       tracked.request.engine or "every", tracked.reason,
                       extra={"fields": {"event": UNANSWERED_EVENT, "request": tracked.request.id,
                                         "engine": tracked.request.engine, "missing": missing,
                                         "answered_by": sorted(tracked.answered_by)}})

    def served(self) -> list[dict[str, Any]]:
        """The requests as ``GET /api/v1/replays`` lists them, newest first."""
        with self.lock:
            return [t.served() for t in sorted(self.tracked.values(), key=lambda t: t.request.id, reverse=True)]

    def run(self, stop: threading.Event) -> None:
        """Sweep every ``POLL_EVERY_S`` until ``stop``: an unanswered request is logged when it expires, whether
        or not anyone lists the requests. A failing sweep is logged once and never ends the thread."""
        failed = False
        while not stop.wait(POLL_EVERY_S):
            try:
                self.sweep()
            except Exception as exc:
                if not failed:
                    failed = True
                    logger.exception("kvobs sidecar: following replay requests failed: %r", exc)
