"""An engine whose events a test scripts, journalled by kvobs's own writer (Observer + JournalSink), for
the scenarios that compare what Prometheus counts with what happened (tests/integration/test_operator_scenarios.py)."""

from __future__ import annotations

import itertools
from pathlib import Path

from kvobs.diagnosis import MISSING
from kvobs.journal import JournalSink
from kvobs.observer import Observer, Unloadable
from kvobs.options import Options
from tests.support.removals import record_removal

_keys = itertools.count(1)


class ScriptedEngine:
    """One engine process's kvobs writer: ``fail()`` is one failed load of one chunk evicted 0.5 s after
    its store (one capacity eviction, one missing chunk with an eviction age); ``restart()`` is vLLM
    restarted in the same pod (a new writer of the same engine)."""

    def __init__(self, directory: Path, engine: str = "0", model_name: str = "m") -> None:
        self.directory, self.options = directory, Options(engine=engine, model_name=model_name)
        self._open()

    def _open(self) -> None:
        self.observer = Observer(self.options)
        self.sink = JournalSink(self.directory, self.observer.options, "test")
        self.observer.add_sink(self.sink)

    def fail(self) -> str:
        """One failed load, its report written and the journal flushed (durably) before it returns: its cause."""
        key = next(_keys).to_bytes(32, "big") + b"\0\0\0\0"
        record_removal(self.observer, [key], "capacity", "store", None, [0.5])
        diagnosis = self.observer.load_failed("Chunk not found in cache", f"req-{key[28:32].hex()}", 1, None,
                                              [Unloadable(key, 0, None, MISSING)], 0)
        self.observer.publish_failure(diagnosis, AssertionError(diagnosis.message))
        return diagnosis.cause

    def restart(self) -> None:
        self.close()
        self._open()

    def close(self) -> None:
        self.sink.close()
