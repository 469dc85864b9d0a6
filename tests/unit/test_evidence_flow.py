"""Evidence flows one way (issue 43, item 2): the recorder applies captures and hands on what it applied
(``Recorder.near``, the removal queue); the observer folds them; neither calls back into the other.

The recorder stops applying where the observer must fold first: after a load whose promises broke, so that
the eviction history judges them as it was at that load, not as later captures of the same drain left it.
Driven with plain callables standing in for vLLM's methods (the integration tests drive vLLM's managers).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvobs.codes import CAPACITY, PATHS
from kvobs.observer import Observer
from kvobs.options import Options

HIT, HIT_PENDING = object(), object()
STORE, LOOKUP = PATHS.index("store"), PATHS.index("lookup")
PROMISED = b"k" * 36


@dataclass
class Ctx:
    req_id: str


def other(i: int) -> bytes:
    return i.to_bytes(36, "big")


def test_a_loads_near_misses_are_judged_against_the_history_as_it_was_at_that_load() -> None:
    observer = Observer(Options(history_size=4096))  # the recorder's short memory: 1,024 keys
    rec = observer.recorder
    lookup = rec.lookup_tap(lambda key, ctx: HIT, path=LOOKUP, hit=HIT, hit_pending=HIT_PENDING, marks_frame=True)
    load = rec.load_tap(lambda keys, ctx: "load spec", on_failure=lambda exc, keys, ctx: None)
    a = Ctx("a")
    with observer._drain_lock:  # every capture below applied in the one drain after: none by kvobs's applier
        assert lookup(PROMISED, a) is HIT
        for i in range(2_100):  # removals of other keys: the promise is now older than the short memory
            rec.removal([other(i)], CAPACITY, None, 0.0, path=STORE)
        assert load([PROMISED], a) == "load spec"  # its key was never removed between the promise and now
        rec.removal([PROMISED], CAPACITY, None, 0.0, path=STORE)  # only after the load
    observer.drain()
    assert rec.recent.exact_from > 0, "the promise is older than the short memory: the history judged it"
    assert sum(observer.near_misses.values()) == 0, observer.near_misses  # not the removal after the load
    assert load([PROMISED], a) == "load spec"  # this load comes after it: a near miss
    observer.drain()
    assert observer.near_misses["capacity"] == 1
    observer.close()


def test_the_journal_never_calls_into_the_observer_and_its_totals_are_what_the_drains_pushed(tmp_path: Path) -> None:
    """The counters reach the journal one way (issue 43, item 2): each drain that changed them pushes a
    ``Snapshot``; the journal's writer thread writes the latest, and never drains or reads the observer."""
    import json
    import threading
    import time

    from kvobs.codes import SNAPSHOT_EVERY_S
    from kvobs.journal import FLUSH_EVERY_S, JournalSink
    from kvobs.wire.format import JOURNAL_DIR
    from tests.support.removals import record_removal

    observer = Observer(Options(engine="0"))
    sink = JournalSink(tmp_path, observer.options)
    observer.add_sink(sink)
    calls_from_writer: list[str] = []
    drain, push = observer.drain, observer._push_snapshot

    def watched(name: str, call: Callable[..., Any]) -> Callable[..., Any]:
        def on_call(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is sink._thread:
                calls_from_writer.append(name)
            return call(*args, **kwargs)
        return on_call

    observer.drain = watched("drain", drain)  # type: ignore[method-assign]
    observer._push_snapshot = watched("_push_snapshot", push)  # type: ignore[method-assign]
    for i in range(5):
        record_removal(observer, [other(i)], "capacity", "store", "r")  # applied and pushed by its drain
    time.sleep(3 * FLUSH_EVERY_S)  # the writer flushes a few times

    def last_totals() -> dict[str, Any]:
        segments = sorted((tmp_path / JOURNAL_DIR).iterdir())
        lines = [json.loads(line) for segment in segments for line in segment.read_text().splitlines()]
        return [line for line in lines if line["k"] == "totals"][-1]

    assert last_totals()["evicted"] == {"capacity": 5}
    observer.recomputes.recomputed(16)  # a count made outside any drain, and nothing else to apply: kvobs's
    time.sleep(SNAPSHOT_EVERY_S + 3 * FLUSH_EVERY_S)  # applier's drains push it within SNAPSHOT_EVERY_S
    assert last_totals()["survive"]["tokens"] == 16
    observer.internal_error("sink", None, said=True)  # likewise, marked for the next drain
    time.sleep(3 * FLUSH_EVERY_S)
    assert last_totals()["errors"] == {"sink": 1}
    assert calls_from_writer == []
    observer.close()
