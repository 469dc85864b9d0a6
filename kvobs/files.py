"""Writing kvobs's files safely: private directories, whole files that survive a crash.

Shared by the engine's journal and the sidecar's checkpoint, and by ``kvobs doctor``'s probe of the journal
directory (:func:`probe_directory`); pure standard library.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
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


def probe_directory(path: Path) -> tuple[str | None, str]:
    """(None, what was found) when kvobs can write files in ``path``, else (why not, ""). The directory is
    created if missing (0700, as kvobs does) and a probe file written in it (and in its ``journal`` and
    ``failures`` subdirectories when they exist); every file and directory made here is removed again."""
    created: list[Path] = []
    try:
        missing = []
        existing = path
        while not os.path.lexists(existing):
            missing.append(existing)
            existing = existing.parent
        if not existing.is_dir():
            return f"cannot be created: {existing} is not a directory", ""
        for directory in reversed(missing):
            directory.mkdir(mode=0o700)
            created.append(directory)
        targets = [path] + [path / sub for sub in ("journal", "failures") if (path / sub).is_dir()]
        for target in targets:
            fd, probe = tempfile.mkstemp(prefix=".kvobs-doctor-", dir=target)
            try:
                os.write(fd, b"kvobs doctor\n")
            finally:
                os.close(fd)
                os.unlink(probe)
    except OSError as exc:
        return f"not writable: {exc.strerror or exc}" + (f" ({exc.filename})" if exc.filename else ""), ""
    finally:
        for directory in reversed(created):
            with contextlib.suppress(OSError):
                directory.rmdir()
    if created:
        return None, "writable (does not exist yet: the engine creates it, 0700)"
    note = "writable"
    owner = path.stat().st_uid
    if owner != os.getuid():
        note += f" (owned by uid {owner}, not this uid {os.getuid()}: run the engine and kvobs serve as one uid)"
    return None, note
