"""Record a removal batch on an Observer from a test, as the policy taps would (queued, then drained).

Test-only, so it lives here rather than on ``kvobs.observer.Observer``; every test directory imports it
(``from tests.support.removals import ...``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from pathlib import Path

from kvobs.codes import PATH_CODE, REASON_CODE
from kvobs.observer import Observer
from kvobs.options import Options


def record_removal(
    observer: Observer,
    keys: Sequence[bytes],
    reason: str,
    path: str,
    req_id: str | None,
    residency_s: Sequence[float] | None = None,
    now: float | None = None,
) -> None:
    """One removal batch of ``keys`` (``reason`` and ``path`` by name), folded at once."""
    observer.recorder.removal(
        list(keys), REASON_CODE[reason], residency_s, time.monotonic() if now is None else now,
        path=PATH_CODE[path], req_id=req_id,
    )
    observer.drain()


def journal_one_removal(directory: Path, *, engine: str = "0", model_name: str = "m") -> None:
    """An engine that journals one capacity removal into ``directory``, then closes: what a sidecar reads."""
    from kvobs.journal import JournalSink

    observer = Observer(Options(engine=engine, model_name=model_name))
    sink = JournalSink(directory, observer.options)
    observer.add_sink(sink)
    record_removal(observer, [os.urandom(36)], "capacity", "store", "r", [0.5])
    sink.close()
