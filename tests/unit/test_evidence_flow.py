"""Evidence flows one way (issue 43, item 2): the recorder applies captures and hands on what it applied
(``Recorder.near``, the removal queue); the observer folds them; neither calls back into the other.

The recorder stops applying where the observer must fold first: after a load whose promises broke, so that
the eviction history judges them as it was at that load, not as later captures of the same drain left it.
Driven with plain callables standing in for vLLM's methods (the integration tests drive vLLM's managers).
"""

from __future__ import annotations

from dataclasses import dataclass

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
