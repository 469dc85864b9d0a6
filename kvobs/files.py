"""Writing kvobs's files safely: private directories, whole files that survive a crash.

Shared by the engine's journal and the sidecar's checkpoint; pure standard library.
"""

from __future__ import annotations

import contextlib
import os
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


def write_durably(path: Path, data: bytes) -> None:
    """Write a whole file so that it survives a crash right after this returns."""
    tmp = path.with_name(f".{path.name}.tmp")
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
