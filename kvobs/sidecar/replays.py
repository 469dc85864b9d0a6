"""The sidecar's replay endpoints: ask the engines for bundles, list them, hand one out.

``POST /api/v1/replays`` (``?engine=E``: only that engine; default every engine of the directory) leaves a
request the engines' journal writers answer within a second or two (kvobs/replay_requests.py): 202 with the
request's id; 429 (``Retry-After``) within ``REQUEST_EVERY_S`` of the last request; 400 for a parameter it
does not know or an engine that is not a label. ``GET /api/v1/replays``: the bundles in ``<dir>/replay/``
and ``<dir>/replay/requested/`` (kvobs.bundles.BUNDLE_FOLDERS), newest first, each with what its header
says (engine, failure or the request it answers, whether it holds a window to replay and, if not, why),
and the requests pending.
``GET /api/v1/replays/<id>``: the bundle's file (``application/zip``), for ``kvobs replay``.
"""

from __future__ import annotations

import os
import zlib
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

from kvobs.bundles import BUNDLE_FOLDERS, BUNDLE_SUFFIX, bundle_files, read_header
from kvobs.replay_requests import make_request, pending
from kvobs.wire.format import REPORT_ID

REPLAYS_PATH = "/api/v1/replays"


class RequestError(ValueError):
    """A bad ``POST /api/v1/replays``: ``parameter`` names what is wrong."""

    def __init__(self, message: str, parameter: str) -> None:
        super().__init__(message)
        self.parameter = parameter


def request(directory: Path, query: str) -> dict[str, Any]:
    """Leave a request for bundles (kvobs.replay_requests.TooSoon when too soon, :class:`RequestError` when
    the query is bad): what the 202 says."""
    params = parse_qs(query, keep_blank_values=True)
    for name in params:
        if name != "engine":
            raise RequestError(f"unknown parameter {name[:100]!r} (this endpoint takes only 'engine')", name[:100])
    engines = params.get("engine", [])
    if len(engines) > 1:
        raise RequestError("'engine' may be given once (leave it out to ask every engine)", "engine")
    try:
        made = make_request(directory, engines[0] if engines else None)
    except ValueError as exc:
        raise RequestError(str(exc), "engine") from None
    return {"request": made.id, "engine": made.engine, "bundles": REPLAYS_PATH,
            "note": "each engine of this directory writing to it answers within seconds with a bundle "
                    "whose 'requested' is this id"}


def listing(directory: Path) -> dict[str, Any]:
    """The bundles, newest first, with what their headers say, and the requests pending."""
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
    return {"bundles": bundles,
            "pending": [{"request": r.id, "engine": r.engine, "created": r.created} for r in pending(directory)]}


def bundle_path(directory: Path, bundle_id: str) -> Path | None:
    """The file of bundle ``bundle_id``, None when there is no such bundle (or the id is not one)."""
    if not REPORT_ID.fullmatch(bundle_id):
        return None
    for folder in BUNDLE_FOLDERS:
        path = directory / folder / f"{bundle_id}{BUNDLE_SUFFIX}"
        if os.path.isfile(path) and not os.path.islink(path):
            return path
    return None
