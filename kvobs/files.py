"""Writing kvobs's files safely: private directories, whole files that survive a crash.

Shared by the engine's journal and the sidecar's checkpoint; pure standard library.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path


def private_dir(path: Path) -> Path:
    """Create ``path`` if needed, and each missing folder above it, 0700 (``mkdir(parents=True)`` would
    create those with the default mode); kvobs writes only inside its directory."""
    missing = []
    folder = path
    while not folder.is_dir() and folder != folder.parent:
        missing.append(folder)
        folder = folder.parent
    for folder in reversed(missing):
        folder.mkdir(mode=0o700, exist_ok=True)
    return path


TEMP_PREFIX, TEMP_SUFFIX = ".", ".tmp"
"""What :func:`write_durably` puts around a file's name for the temporary file it writes it through (hidden,
so no reader lists it)."""


def temp_name(name: str) -> str:
    return f"{TEMP_PREFIX}{name}{TEMP_SUFFIX}"


def remove_stale_temps(folder: Path, suffix: str, older_than_s: float) -> None:
    """Delete :func:`write_durably`'s temporary files of names ending in ``suffix`` in ``folder`` that are
    older than ``older_than_s``: a process died writing them (a live writer's is younger)."""
    deadline = time.time() - older_than_s
    with contextlib.suppress(OSError):
        for entry in os.scandir(folder):
            if entry.name.startswith(TEMP_PREFIX) and entry.name.endswith(suffix + TEMP_SUFFIX):
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_mtime < deadline:
                        os.unlink(entry.path)


def write_durably(path: Path, data: bytes) -> None:
    """Write a whole file so that it survives a crash right after this returns."""
    tmp = path.with_name(temp_name(path.name))
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        write_all(fd, data)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, path)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            tmp.unlink()  # a full disk must not also collect half-written temp files
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is out (a nearly full disk writes short before it fails)."""
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        view = view[written:]


def keep_newest(paths_newest_first: list[Path], keep: int) -> None:
    """Delete all but the first ``keep`` of ``paths_newest_first`` (another writer may have deleted some)."""
    for stale in paths_newest_first[keep:]:
        with contextlib.suppress(FileNotFoundError):
            stale.unlink()


def hold(fd: int) -> None:
    """Mark an open journal segment as its writer's for as long as the writer lives: a shared ``flock``, which
    the kernel drops when the process dies, however it dies (kvobs.journal's writers; :func:`held` reads it)."""
    with contextlib.suppress(OSError):  # a file system without flock: readers fall back to last writes
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)


def held(path: Path) -> bool | None:
    """Whether a live writer holds ``path`` (:func:`hold`); None when this file system cannot tell. Here, not in
    kvobs.journal, because the sidecar asks too (whether an engine is alive to answer a replay request) and
    imports neither numpy nor the hot path that kvobs.journal does."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return False  # gone, or not a file kvobs writes
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return None
    finally:
        os.close(fd)  # closing drops the probe's lock
    return False
