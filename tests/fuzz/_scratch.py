"""What the targets share: a private scratch directory per process, logging kept quiet, and the error a
target raises when a reader breaks its contract in a way that is not an exception of its own."""

from __future__ import annotations

import atexit
import logging
import shutil
import tempfile
from pathlib import Path

_made: list[Path] = []


def _remove() -> None:
    for path in _made:
        shutil.rmtree(path, ignore_errors=True)


def scratch(name: str) -> Path:
    """A fresh directory for this process (removed at exit)."""
    path = Path(tempfile.mkdtemp(prefix=f"kvobs-fuzz-{name}-"))
    if not _made:
        atexit.register(_remove)
    _made.append(path)
    return path


def quiet() -> None:
    """The readers log what they skip (once per name): under a fuzzer that is noise, not a finding. Process-wide
    (``logging.disable``), so only run.py's fuzzing worker calls it, never a test process."""
    logging.disable(logging.CRITICAL)


class ContractBroken(AssertionError):
    """A reader returned something its contract rules out (a crash for the fuzzer)."""
