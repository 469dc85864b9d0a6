"""Replay bundles on demand: the sidecar leaves a request file, each engine's journal writer answers it.

The sidecar and the engines share only their directory, so a request is a file: ``POST /api/v1/replays``
(kvobs/sidecar/replay_endpoints.py) writes ``<dir>/replay/requests/<ms>.request`` (JSON: the engine asked, or
every engine), and the journal writer thread of each engine with that directory (kvobs/journal.py) looks
every ``POLL_EVERY_S`` and writes one bundle per request meant for it (kvobs/vllm/flight_recorder.py,
``answer``), off the scheduler thread. Bounded: one request per ``REQUEST_EVERY_S`` (the sidecar refuses
more), each answered once per engine process and ignored, then deleted by the sidecar, after
``REQUEST_TTL_S``; bundles are pruned to kvobs.bundles.MAX_BUNDLES as at a failure. The sidecar leaves a
request only for an engine alive to answer it, and says which requests went unanswered
(kvobs/sidecar/replay_endpoints.py: ``answerable``, ``Tracker``).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvobs import forks
from kvobs.bundles import BUNDLE_DIR
from kvobs.files import private_dir, write_durably
from kvobs.wire.format import is_engine_label

REQUESTS_DIR = "requests"
"""Under ``<dir>/replay/``."""
REQUEST_SUFFIX = ".request"
REQUEST_EVERY_S = 10.0
"""The sidecar takes one request per this many seconds (a bundle costs an engine a fraction of a second of
CPU, and its process's GIL)."""
REQUEST_TTL_S = 60.0
"""An engine answers a request until it is this old; the sidecar then deletes it."""
CLOCK_SLACK_S = 5.0
"""How far "in the future" a request may be (clocks of two containers, a step back) and still count."""
POLL_EVERY_S = 1.0
"""How often an engine's journal writer looks for requests."""
MAX_REQUEST_BYTES = 1024

_making = threading.Lock()
forks.track(sys.modules[__name__])  # the lock is renewed in a forked child (kvobs/forks.py)


@dataclass(frozen=True)
class Request:
    """A request for bundles: its id (the file's stem), when it was made, the engine it asks (None: all)."""

    id: str
    created: float
    engine: str | None

    def meant_for(self, engine: str) -> bool:
        return self.engine is None or self.engine == engine


def requests_dir(directory: str | os.PathLike[str]) -> Path:
    return Path(directory) / BUNDLE_DIR / REQUESTS_DIR


def _live(request: Request, now: float) -> bool:
    """Younger than ``REQUEST_TTL_S``; one made "later than now" (the clock was stepped back since) is live for
    at most ``CLOCK_SLACK_S`` ahead, else it would never expire and would block every new request."""
    return -CLOCK_SLACK_S <= now - request.created < REQUEST_TTL_S


def _request_files(folder: Path) -> list[os.DirEntry[str]]:
    """The folder's regular ``*.request`` files (a FIFO of that name would block whoever opens it)."""
    return [entry for entry in os.scandir(folder)
            if entry.name.endswith(REQUEST_SUFFIX) and entry.is_file(follow_symlinks=False)]


def pending(directory: str | os.PathLike[str], now: float | None = None) -> list[Request]:
    """The live requests, oldest first. A folder that cannot be read, or a file that does not parse, gives
    none: a request is a hint, never worth a fault (the sidecar lists what is pending)."""
    now = time.time() if now is None else now
    try:
        entries = _request_files(requests_dir(directory))
    except OSError:
        return []
    found = []
    for entry in sorted(entries, key=lambda e: e.name):
        request = _read(Path(entry.path))
        if request is not None and _live(request, now):
            found.append(request)
    return found


def _read(path: Path) -> Request | None:
    try:
        with open(path, "rb") as file:
            data = json.loads(file.read(MAX_REQUEST_BYTES))
        created, engine = float(data["created"]), data["engine"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if engine is not None and not is_engine_label(engine):
        return None
    return Request(path.name[: -len(REQUEST_SUFFIX)], created, engine)


class TooSoon(Exception):
    """A request was made less than ``REQUEST_EVERY_S`` ago; ``retry_after`` seconds until the next may."""

    def __init__(self, retry_after: float) -> None:
        super().__init__(f"one request per {REQUEST_EVERY_S:g} s: try again in {retry_after:.1f} s")
        self.retry_after = retry_after


def make_request(directory: str | os.PathLike[str], engine: str | None, now: float | None = None) -> Request:
    """Leave a request (the sidecar); expired ones go first. ``engine`` must be an engine label or None;
    :class:`TooSoon` if the newest request is younger than ``REQUEST_EVERY_S``."""
    now = time.time() if now is None else now
    if engine is not None and not is_engine_label(engine):
        raise ValueError(f"not an engine label: {engine!r:.100}")
    with _making:  # the sidecar serves each connection on a thread: one check-then-write at a time
        folder = private_dir(requests_dir(directory))
        newest = None
        for entry in _request_files(folder):
            request = _read(Path(entry.path))
            if request is None or not _live(request, now):
                Path(entry.path).unlink(missing_ok=True)
            elif newest is None or request.created > newest:
                newest = request.created
        if newest is not None and now - newest < REQUEST_EVERY_S:
            raise TooSoon(REQUEST_EVERY_S - max(now - newest, 0.0))
        request_id = f"{int(now * 1000):015d}"
        data = json.dumps({"created": now, "engine": engine}).encode()
        write_durably(folder / f"{request_id}{REQUEST_SUFFIX}", data)
    return Request(request_id, now, engine)


class Answerer:
    """An engine's side: ``poll()`` (its journal writer calls it every round) calls ``answer(request)``
    once for each new request meant for ``engine``, at most every ``POLL_EVERY_S``."""

    def __init__(self, directory: str | os.PathLike[str], engine: str, answer: Callable[[Request], None]) -> None:
        self.directory = directory
        self.engine = engine
        self.answer = answer
        self._answered: set[str] = set()
        self._next_poll = 0.0

    def poll(self) -> None:
        now = time.monotonic()
        if now < self._next_poll:
            return
        self._next_poll = now + POLL_EVERY_S
        requests = pending(self.directory)
        self._answered &= {request.id for request in requests}  # bounded: only requests still pending
        for request in requests:
            if request.id not in self._answered and request.meant_for(self.engine):
                self._answered.add(request.id)
                self.answer(request)
