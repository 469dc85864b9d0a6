"""A replay bundle's file: its format, its name and how many are kept; what an engine writes
(kvobs/vllm/flight_recorder.py), the sidecar lists and serves (kvobs/sidecar/replay_endpoints.py) and ``kvobs replay``
reads (kvobs/vllm/bundle_replay.py). Pure standard library: the sidecar imports it.

A bundle is a zip: ``bundle.json`` (what a person reads: versions, options, the failure or the request it
answers, whether it holds a window and, if not, why) and ``window.msgpack`` (the state and the calls a replay
makes: kvobs.flight.Window, plain values; docs/design.md, "Replay bundles", documents both). Nothing in a
bundle is unpickled or executed where it is read (SECURITY.md).
"""

from __future__ import annotations

import io
import json
import os
import time
import zipfile
import zlib
from pathlib import Path
from typing import Any

from kvobs.files import keep_newest, private_dir, remove_stale_temps, write_durably
from kvobs.wire.format import REPORT_ID, report_engine, report_name, report_time_ms

MAX_BUNDLES = 4
"""Replay bundles kept: of failures, all engines together; of requests, each engine's (the oldest deleted);
each at most ``flight_bytes`` and ``MAX_HEADER_BYTES``: kvobs.journal.disk_bound counts them."""
MAX_HEADER_BYTES = 64 * 2**10
"""A bundle's ``bundle.json`` at most (a bundle without a window is only that): kvobs.journal.disk_bound."""
BUNDLE_DIR = "replay"
"""Under ``<dir>``: the bundles of failed loads."""
REQUESTED_DIR = "requested"
"""Under ``<dir>/replay/``: the bundles the sidecar asked for (kvobs/replay_requests.py), kept apart, so that
asking for bundles never pushes out a failure's: the failures' folder keeps its newest ``MAX_BUNDLES``, this
one the newest ``MAX_BUNDLES`` of each engine."""
BUNDLE_FOLDERS = (BUNDLE_DIR, f"{BUNDLE_DIR}/{REQUESTED_DIR}")
STALE_TEMP_S = 60.0
"""A bundle's temporary file older than this was left by a process that died writing it: deleted."""
BUNDLE_SUFFIX = ".kvobs-replay.zip"
BUNDLE_FORMAT = 2
"""2: the window is kvobs.flight.Window (MessagePack of values). 1 held a pickle and is refused, never read."""
HEADER = "bundle.json"
WINDOW = "window.msgpack"



def bundle_files(folder: Path) -> list[Path]:
    """The bundles in ``folder`` (``<dir>/replay/``), newest first: only names kvobs writes (their stem a
    kvobs.wire.format.REPORT_ID, as a failure report's)."""
    try:
        names = [entry.name for entry in os.scandir(folder) if entry.is_file(follow_symlinks=False)]
    except FileNotFoundError:
        return []
    stems = (name[: -len(BUNDLE_SUFFIX)] for name in names if name.endswith(BUNDLE_SUFFIX))
    return [folder / f"{stem}{BUNDLE_SUFFIX}" for stem in sorted(stems, reverse=True) if REPORT_ID.fullmatch(stem)]


def new_bundle(folder: Path, engine: str, pid: int, n: int) -> Path:
    """The next bundle's path in ``folder`` (which it creates, 0700): named as a failure report is
    (kvobs.wire.format.report_name), after the newest bundle there whatever the wall clock says."""
    newest = bundle_files(private_dir(folder))[:1]
    after = report_time_ms(newest[0].name) if newest else None
    return folder / report_name(time.time(), engine, pid, n, -1 if after is None else after, BUNDLE_SUFFIX)


def bundle_engine(path: Path) -> str:
    """The engine a bundle's name says wrote it (``<ms>-<engine>-<pid>-<n>``; an engine label may hold '-')."""
    return report_engine(path.name[: -len(BUNDLE_SUFFIX)]) or ""


def keep_bundles(folder: Path, engine: str | None = None) -> None:
    """Delete all but the newest ``MAX_BUNDLES`` bundles of ``folder``: every engine's together, or only
    ``engine``'s (the requested ones: each engine answers every request, so each keeps its own); and any
    temporary file a process died writing (older than ``STALE_TEMP_S``)."""
    bundles = bundle_files(folder)
    keep_newest(bundles if engine is None else [b for b in bundles if bundle_engine(b) == engine], MAX_BUNDLES)
    remove_stale_temps(folder, BUNDLE_SUFFIX, STALE_TEMP_S)


def _fitted(value: Any, limit: int) -> Any:
    """``value`` with every string longer than ``limit`` cut to it (a header's messages and reasons)."""
    if isinstance(value, str) and len(value) > limit:
        return value[:limit] + " [cut]"
    if isinstance(value, dict):
        return {k: _fitted(v, limit) for k, v in value.items()}
    if isinstance(value, list):
        return [_fitted(v, limit) for v in value]
    return value


def write_bundle(path: str, header: dict[str, Any], window: bytes | None) -> int:
    """Write a bundle: ``bundle.json`` (what a person reads) and ``window.msgpack`` (the state and calls a
    replay makes); its size in bytes. Whole or not at all, private (0600), durable (kvobs.files). The header
    takes at most ``MAX_HEADER_BYTES`` (its longest strings cut)."""
    header = {"format": BUNDLE_FORMAT, **header}
    text = json.dumps(header, indent=2, sort_keys=True, default=str)
    limit = 4096
    while len(text.encode()) > MAX_HEADER_BYTES and limit > 16:
        text = json.dumps(_fitted(header, limit), indent=2, sort_keys=True, default=str)
        limit //= 4
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", compression=zipfile.ZIP_DEFLATED) as bundle:
        bundle.writestr(HEADER, text)
        if window is not None:
            bundle.writestr(WINDOW, window)
    data = buffer.getvalue()
    write_durably(Path(path), data)
    return len(data)


def read_header(path: str) -> dict[str, Any]:
    """A bundle's ``bundle.json``; raises ValueError naming what is wrong with the file."""
    try:
        with zipfile.ZipFile(path) as bundle:
            header = json.loads(_member(bundle, HEADER, MAX_HEADER_BYTES))
    except (OSError, zipfile.BadZipFile, zlib.error, KeyError, ValueError, EOFError, RuntimeError,
            NotImplementedError, RecursionError) as exc:
        raise ValueError(f"{path}: not a kvobs replay bundle ({type(exc).__name__}: {exc})") from None
    found = header.get("format") if isinstance(header, dict) else None
    if not isinstance(header, dict) or found != BUNDLE_FORMAT:
        older = " (format 1 held a pickle: replay it with the kvobs that wrote it, if you trust it)" \
            if found == 1 else ""
        raise ValueError(f"{path}: bundle format {found!r}, this kvobs reads format {BUNDLE_FORMAT}{older}")
    return header


def _member(bundle: zipfile.ZipFile, name: str, limit: int) -> bytes:
    """A member's bytes, refused (ValueError) when it unpacks to more than ``limit``, before it is read."""
    info = bundle.getinfo(name)
    if info.file_size > limit:
        raise ValueError(f"{name} unpacks to {info.file_size} bytes, over {limit}")
    with bundle.open(info) as member:
        data = member.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{name} unpacks to over {limit} bytes")
    return data


def read_window(path: str, limit: int) -> bytes:
    """A bundle's ``window.msgpack``, its bytes (ValueError if it has none, its header says why, if it unpacks
    to more than ``limit``, the writer's ``flight_bytes``, or if the file is not a bundle)."""
    try:
        with zipfile.ZipFile(path) as bundle:
            return _member(bundle, WINDOW, limit)
    except KeyError:
        raise ValueError(f"{path}: the bundle holds no window to replay") from None
    except (OSError, zipfile.BadZipFile, zlib.error, ValueError, EOFError, RuntimeError, NotImplementedError) as exc:
        raise ValueError(f"{path}: the window does not read ({type(exc).__name__}: {exc})") from None

