"""The capture buffer a recorder's taps append to (``Recorder.captures``, kvobs/hot_path.py), in two forms.

:class:`PythonCaptureRing` is the reference: a deque, the time read with ``time.monotonic()``. The C form
(kvobs/_capture_ring.c, built by setup.py where a C compiler is present) does the same without allocating
anything per append: its fields go in through one vectorcall, and the time is read in C and stored as a
double, made a float only when popped on kvobs's applier (issue 43, item 1: an object per call is what the
garbage collector walked). tests/unit/test_capture_ring.py runs both on the same operations.

:data:`CaptureRing` is the form that runs: the C one, unless it was not built or ``KVOBS_PURE_PYTHON`` asks
for Python everywhere (kvobs.hot_path_loader, whose choice for the hot path reads :func:`python_asked` too).
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Iterable
from typing import Any

logger = logging.getLogger("kvobs")

PURE_PYTHON_ENV = "KVOBS_PURE_PYTHON"


def python_asked() -> bool:
    """Whether ``KVOBS_PURE_PYTHON`` asks for every part of kvobs in Python (the compiled forms left aside)."""
    return os.environ.get(PURE_PYTHON_ENV, "") not in ("", "0")


class PythonCaptureRing:
    """References and times, oldest first. ``push`` and ``push_timed`` are each one ``deque.extend``, which
    no other thread's append can split; ``popleft`` on another thread never loses one. It makes a tuple per
    push (and a float per time): the C form's saving."""

    __slots__ = ("_extend", "_items", "clear", "popleft")

    def __init__(self) -> None:
        self._items: deque[Any] = deque()
        self._extend = self._items.extend
        self.popleft = self._items.popleft
        self.clear = self._items.clear

    def push(self, *items: Any) -> None:
        """Each item, in order."""
        self._extend(items)

    def push_timed(self, *items: Any) -> None:
        """Each item, then the monotonic time now."""
        self._extend((*items, time.monotonic()))

    def extend(self, items: Iterable[Any]) -> None:
        """Each of ``items``, in order."""
        self._extend(tuple(items))

    def __len__(self) -> int:
        return len(self._items)


def _ring_type() -> tuple[type[Any], str]:
    if python_asked():
        return PythonCaptureRing, "python"
    try:
        from kvobs._capture_ring import CaptureRing as CRing
    except ImportError:  # not built (no C compiler when kvobs was installed): the reference, said once
        logger.info("kvobs: the C capture ring is not built; captures go to its Python form")
        return PythonCaptureRing, "python"
    return CRing, "c"


CaptureRing, RING_FORM = _ring_type()
"""The ring that runs (``RING_FORM``: ``"c"`` or ``"python"``)."""
