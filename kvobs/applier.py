"""kvobs's applier thread: it applies what the taps captured on vLLM's scheduler thread (issue 33).

One daemon thread per process serves every observer in it, so a test suite or an engine with many
managers starts one thread, not one each. It holds observers by weak reference (a dropped observer is
collected as before), wakes every ``APPLY_EVERY_S`` or when a recorder's buffer passes
``CAPTURE_WAKE`` (``Recorder.capture``), and has each observer drain without waiting for a drain
already running on another thread (``Observer.drain(block=False)``). Nothing depends on it for
correctness: every reader of the evidence, and a failed load first of all, applies what is waiting
itself; the thread only takes that work off the scheduler thread. After a fork the child starts its
own thread on the first wake.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from typing import Protocol

from kvobs import forks
from kvobs.codes import APPLY_EVERY_S

logger = logging.getLogger("kvobs")
THREAD_NAME = "kvobs-apply"


class Drains(Protocol):
    applier_cpu_s: float
    """CPU seconds this thread spent applying for the observer (benchmarks add it to the process's figure)."""

    def drain(self, block: bool = True) -> None: ...


class Applier:
    """The process's applier thread and the observers it serves."""

    def __init__(self, every_s: float = APPLY_EVERY_S) -> None:
        self.every_s = every_s
        self._observers: weakref.WeakSet[Drains] = weakref.WeakSet()
        self._wake = threading.Event()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def serve(self, observer: Drains) -> None:
        """Apply ``observer``'s captures from now on (the thread starts with the first observer)."""
        self._observers.add(observer)
        self._start()

    def forget(self, observer: Drains) -> None:
        """Stop applying for ``observer`` (closed: it drained itself)."""
        self._observers.discard(observer)

    def wake(self) -> None:
        """Apply soon (a recorder's buffer passed ``CAPTURE_WAKE``); starts the thread again if it is gone."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            self._start()
        self._wake.set()

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                return
            thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
            thread.start()
            self._thread = thread

    def _run(self) -> None:
        wake = self._wake
        while True:
            wake.wait(self.every_s)
            wake.clear()
            for observer in list(self._observers):
                started = time.thread_time()
                try:
                    observer.drain(block=False)
                except BaseException as exc:  # Observer.drain counts its own faults; this thread must go on
                    logger.error("kvobs applier: %r", exc)
                spent = time.thread_time() - started
                observer.applier_cpu_s += spent

    def _forked(self) -> None:
        """In a forked child (kvobs/forks.py renewed the lock and the event first): the parent's thread is not
        there; the next wake or observer starts one (restarted lazily)."""
        self._thread = None


APPLIER = Applier()
"""The process's one applier."""
forks.track(APPLIER)
