"""The capture ring's C form against its Python reference (kvobs/capture_ring.py, kvobs/_capture_ring.c).

Both take the same random operations and must give back the same items in the same order; a time pushed
with ``push_timed`` must read the clock ``time.monotonic()`` reads. The C form must also own its references
as Python would: kept while held, released when popped or dropped, and a cycle through it collectable.
"""

from __future__ import annotations

import gc
import sys
import time
import weakref
from typing import Any

from hypothesis import given, settings, strategies as st

from kvobs._capture_ring import CaptureRing as CRing
from kvobs.capture_ring import CaptureRing, PythonCaptureRing

RINGS = (CRing, PythonCaptureRing)

_items = st.lists(st.one_of(st.integers(), st.text(max_size=4), st.binary(max_size=8), st.none()), max_size=6)
_ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), _items),
        st.tuples(st.just("push_timed"), _items),
        st.tuples(st.just("extend"), _items),
        st.tuples(st.just("pop"), st.integers(0, 700)),
        st.tuples(st.just("clear"), st.none()),
        st.tuples(st.just("bulk"), st.integers(0, 1500)),  # past the first capacity (1,024): the ring grows
    ),
    max_size=60,
)


class _Time:
    """Where the reference model expects a time: between these two readings of time.monotonic()."""

    def __init__(self, low: float, high: float) -> None:
        self.low, self.high = low, high


def _run(ring_type: type[Any], ops: list[tuple[str, Any]]) -> list[Any]:
    """The ops on a ring of ``ring_type``, against a list as the model; what was popped, checked on the way."""
    ring = ring_type()
    model: list[Any] = []
    popped: list[Any] = []
    for op, arg in ops:
        if op == "push":
            ring.push(*arg)
            model.extend(arg)
        elif op == "push_timed":
            low = time.monotonic()
            ring.push_timed(*arg)
            model.extend([*arg, _Time(low, time.monotonic())])
        elif op == "extend":
            ring.extend(iter(arg))
            model.extend(arg)
        elif op == "bulk":
            ring.extend(range(arg))
            model.extend(range(arg))
        elif op == "clear":
            ring.clear()
            model.clear()
        else:
            for _ in range(arg):
                if not model:
                    try:
                        ring.popleft()
                    except IndexError:
                        break
                    raise AssertionError("popleft from an empty ring returned an item")
                expected, got = model.pop(0), ring.popleft()
                if isinstance(expected, _Time):
                    assert type(got) is float and expected.low <= got <= expected.high, (expected.low, got)
                    popped.append("<time>")
                else:
                    assert got is expected or got == expected, (got, expected)
                    popped.append(got)
        assert len(ring) == len(model)
        assert bool(ring) == bool(model)
    return popped


@settings(max_examples=300, deadline=None)
@given(_ops)
def test_the_c_ring_gives_back_what_the_python_ring_gives_back(ops: list[tuple[str, Any]]) -> None:
    assert _run(CRing, ops) == _run(PythonCaptureRing, ops)


def test_the_ring_keeps_its_order_across_wraps_and_growth() -> None:
    for ring_type in RINGS:
        ring = ring_type()
        expected: list[int] = []
        n = 0
        for round_ in range(40):  # pushes and pops interleaved: the head walks round the array, then it grows
            for _ in range(97 + 13 * round_):
                ring.push(n)
                expected.append(n)
                n += 1
            for _ in range(61):
                assert ring.popleft() == expected.pop(0)
        assert [ring.popleft() for _ in range(len(ring))] == expected, ring_type


def test_the_c_ring_owns_its_references_as_python_does() -> None:
    token = object()
    base = sys.getrefcount(token)
    ring = CRing()
    ring.push(token, token)
    ring.push_timed(token)
    ring.extend([token])
    assert sys.getrefcount(token) == base + 4
    assert ring.popleft() is token
    assert sys.getrefcount(token) == base + 3
    ring.clear()
    assert sys.getrefcount(token) == base
    ring.push(token)
    del ring
    assert sys.getrefcount(token) == base


def test_a_cycle_through_the_c_ring_is_collected() -> None:
    class Holder:
        ring: Any

    holder = Holder()
    holder.ring = CRing()
    holder.ring.push(holder)  # holder -> ring -> holder: only the collector can free it
    gone = weakref.ref(holder)
    del holder
    gc.collect()
    assert gone() is None


def test_the_time_is_the_clock_time_monotonic_reads() -> None:
    ring = CRing()
    for _ in range(1000):
        low = time.monotonic()
        ring.push_timed()
        high = time.monotonic()
        got = ring.popleft()
        assert low <= got <= high


def test_the_ring_that_runs_is_the_c_one_unless_python_is_asked(monkeypatch: Any) -> None:
    import importlib

    import kvobs.capture_ring as module

    assert CaptureRing is (PythonCaptureRing if module.python_asked() else CRing)
    monkeypatch.setenv(module.PURE_PYTHON_ENV, "1")
    try:
        assert importlib.reload(module).CaptureRing is module.PythonCaptureRing
    finally:
        monkeypatch.undo()
        importlib.reload(module)
