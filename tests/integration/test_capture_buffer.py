"""Capture, then apply (issue 33; docs/design.md, "Capture, then apply"), on vLLM's real CPU manager.

The taps only capture on vLLM's thread; the recording is applied later, by kvobs's applier thread, a
reader or a failed load. Each test runs the same seeded traffic through a second observed manager that
applies after every call (what recording inline did) and asserts the evidence is the same: a failure
behind thousands of captures not yet applied, a buffer that fills up, and the applier thread racing
the traffic.
"""

from __future__ import annotations

import gc
import random
import re
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from vllm.v1.kv_offload.base import LookupResult

from kvobs.applier import APPLIER
from kvobs.vllm import ObservedOffloadingManager
from tests.support.causes import END, ctx, failed_load, observed, store
from tests.support.vllm_env import cpu_extra, create_manager, key

CHUNKS = 8
POOL = 40


def drive(m: ObservedOffloadingManager, seed: int, steps: int, after_each: Callable[[], None]) -> None:
    """Seeded traffic that stores, evicts, looks up, loads what it found and finishes requests (no load
    fails): ``after_each`` runs after every manager call."""
    rng = random.Random(seed)
    live = []
    for step in range(steps):
        context = ctx(m, f"req-{step}")
        after_each()
        live.append(context)
        wanted = [key(rng.randrange(POOL)) for _ in range(rng.randint(1, 3))]
        found = []
        for k in dict.fromkeys(wanted):
            answer = m.lookup(k, context)
            after_each()
            if answer is LookupResult.HIT:
                found.append(k)
        if found and rng.random() < 0.7:
            m.prepare_load(found, context)
            after_each()
            m.complete_load(found, context)
            after_each()
        fresh = [k for k in dict.fromkeys(key(rng.randrange(POOL)) for _ in range(rng.randint(1, 4)))
                 if k not in found]
        if fresh:
            out = m.prepare_store(fresh, context)
            after_each()
            if out is not None:
                m.complete_store(list(out.keys_to_store), context, rng.random() > 0.05)
                after_each()
        if len(live) > 3:
            m.on_request_finished(live.pop(0))
            after_each()
        m.on_schedule_end(END)
        after_each()


def evidence(m: ObservedOffloadingManager) -> dict[str, object]:
    """Everything the recording computes, read through the observer (which applies first)."""
    o = m.observer
    history = o.history
    return {"evicted": dict(o.evicted), "batches": dict(o.batches), "near": dict(o.near_misses),
            "unread": o.counter("unread"), "loaded": o.counter("loaded"), "stored": o.counter("stored"),
            "promises": len(o.promises), "serial": history.next_serial, "keys": history.stats().keys,
            "last": [None if r is None else (r.serial, r.reason, r.path, r.req_id)
                     for r in history.last_removals([key(i) for i in range(POOL)])],
            "errors": +o.internal_errors}


@pytest.fixture
def no_applier_thread() -> Iterator[Callable[[ObservedOffloadingManager], None]]:
    """Keeps kvobs's applier thread away from the managers given, so their captures wait."""
    left: list = []

    def leave_alone(m: ObservedOffloadingManager) -> None:
        APPLIER.forget(m.observer)
        left.append(m.observer)

    yield leave_alone
    for observer in left:
        APPLIER.serve(observer)


def test_a_failure_behind_thousands_of_captures_is_diagnosed_from_all_of_them(
    managers: list, no_applier_thread: Callable[[ObservedOffloadingManager], None]
) -> None:
    results = []
    for applied_inline in (False, True):
        m = observed(managers, cpu_extra(CHUNKS))
        no_applier_thread(m)
        after_each = m.observer.drain if applied_inline else (lambda: None)
        a = ctx(m, "req-a", {key(99): 64})
        store(m, [key(99)], a)
        assert m.lookup(key(99), a) is LookupResult.HIT  # the promise, then thousands of calls after it
        drive(m, seed=3, steps=1000, after_each=after_each)
        waiting = m.observer.recorder.captured
        assert waiting == 0 if applied_inline else waiting > 3000
        match = failed_load(m, [key(99)], a)
        assert m.observer.recorder.captured == 0
        results.append((match["cause"], match["hist"], re.sub(r"\d+\.\d+", "X", match["evidence"]),
                        evidence(m)))
    assert results[0] == results[1]
    cause, _, text, facts = results[0]
    assert cause == "evicted_after_lookup" and "capacity removal" in text and "path=store" in text
    assert facts["errors"] == {}


def test_a_full_buffer_is_applied_where_it_filled_and_counted_nothing_lost(
    managers: list, no_applier_thread: Callable[[ObservedOffloadingManager], None]
) -> None:
    twin = observed(managers, cpu_extra(CHUNKS))
    drive(twin, seed=5, steps=300, after_each=twin.observer.drain)
    m = observed(managers, cpu_extra(CHUNKS))
    no_applier_thread(m)
    rec = m.observer.recorder
    rec._capture_wake, rec._capture_limit = 32, 64  # the limit (65,536 by default), small enough to reach
    most = [0]

    def watch() -> None:
        most[0] = max(most[0], rec.captured)

    drive(m, seed=5, steps=300, after_each=watch)
    full = rec.counts["capture"]["full"]  # counted on vLLM's thread, as the buffer filled
    assert most[0] < 64 and full > 5
    assert m.observer.counter("capture") == {"full": full}
    assert evidence(m) == evidence(twin)


def test_the_applier_thread_racing_the_traffic_records_what_inline_recording_did(managers: list) -> None:
    twin = observed(managers, cpu_extra(CHUNKS))
    drive(twin, seed=11, steps=2000, after_each=twin.observer.drain)
    m = observed(managers, cpu_extra(CHUNKS))
    m.observer.recorder._capture_wake = 8  # wake the applier all the time
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # and switch threads every few bytecodes
    try:
        drive(m, seed=11, steps=2000, after_each=lambda: None)
    finally:
        sys.setswitchinterval(old)
    deadline = time.monotonic() + 10  # on a loaded machine the thread may first run after the traffic
    while m.observer.applier_cpu_s == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert m.observer.applier_cpu_s > 0  # the thread applied (some of) it
    assert evidence(m) == evidence(twin)


def test_pending_captures_leave_the_garbage_collector_nothing_to_walk(
    managers: list, no_applier_thread: Callable[[ObservedOffloadingManager], None]
) -> None:
    """A capture is appended flat, its fields into one ring (issue 43): thousands of lookups, loads and finishes
    waiting to be applied add no object the collector tracks, where a tuple per capture that held vLLM's request
    context added one each (and the collections vLLM's own allocations trigger walked them)."""
    young: dict[str, int] = {}
    calls = 3000
    for side in ("bare", "observed"):
        # The evidence's captures alone (the flight recorder's: the next test).
        m: Any = create_manager(cpu_extra(CHUNKS)) if side == "bare" else observed(managers, cpu_extra(CHUNKS),
                                                                                   flight_calls=0)
        if side == "observed":
            no_applier_thread(m)
        contexts = [ctx(m, f"req-{i}") for i in range(calls // 3)]
        store(m, [key(1)], contexts[0])
        waiting = m.observer.recorder.captured if side == "observed" else 0  # the store's, its count among them
        gc.collect()
        gc.disable()
        try:
            before = len(gc.get_objects(generation=0))
            for context in contexts:
                assert m.lookup(key(1), context) is LookupResult.HIT
                assert m.lookup(key(2), context) is LookupResult.MISS
                m.on_request_finished(context)
            young[side] = len(gc.get_objects(generation=0)) - before
        finally:
            gc.enable()
        if side == "observed":
            assert m.observer.recorder.captured == waiting + calls  # all of them still waiting
        else:
            m.shutdown()
    assert young["observed"] - young["bare"] < calls // 100, young


def test_the_flight_recorders_window_leaves_the_garbage_collector_nothing_to_walk(
    managers: list, no_applier_thread: Callable[[ObservedOffloadingManager], None]
) -> None:
    """The flight recorder keeps every call in columns (kvobs.hot_captures.FlightSegment): thousands of stores
    and completions, ``success`` passed as vLLM's connector passes it, captured and then applied into the window
    add no object per call that the collector tracks. A list and a tuple per completion (its ``success`` kept
    as an "extra"), as before, added two each."""
    calls = 1000
    grown: dict[str, int] = {}
    for side in ("observed", "observed+flight"):
        flight = {"flight_calls": 1_000_000 if side == "observed+flight" else 0}  # on by default: off asked
        m = observed(managers, cpu_extra(CHUNKS), **flight)
        no_applier_thread(m)
        contexts = [ctx(m, f"req-{i}") for i in range(calls)]
        m.observer.drain()
        gc.collect()
        gc.disable()
        try:
            before = len(gc.get_objects())
            for i, context in enumerate(contexts):
                keys = [key(i % (2 * CHUNKS))]
                if m.prepare_store(keys, context) is not None:
                    m.complete_store(keys, context, success=True)
            m.observer.drain()
            grown[side] = len(gc.get_objects()) - before
        finally:
            gc.enable()
        if side == "observed+flight":
            assert m.observer.flight is not None and m.observer.flight.calls >= 2 * calls - CHUNKS, \
                "the recorder kept the calls"
    assert grown["observed+flight"] - grown["observed"] < calls // 20, grown
