"""Where a kvobs engine's scheduler-thread time goes: kvobs's own code or vLLM's (benchmarks/engine.py).

An A/B of two engines cannot resolve a cost of 1% on this shared machine (docs/performance.md §4: one
pair's ratio moves by 10-25%). This measures kvobs's share inside one engine instead, where the noise
hits both shares alike: every callable kvobs puts between vLLM and its manager (the manager's taps,
``kvobs.vllm.manager._taps``; the cache policy's taps, ``kvobs.vllm.compat.hook_policy``) and every
vLLM callable they wrap is timed with ``perf_counter_ns``, and each timed span's time goes to its
owner minus its timed children's (exclusive time, as a profiler counts it). vLLM's code that calls
kvobs is vLLM's; vLLM's code kvobs calls (the wrapped methods) is vLLM's; everything between is kvobs's.

A timer costs something, and the part of a child's timer that runs outside its own window lands in
its parent's exclusive time; that leak is measured at start-up on empty nested timers and taken off
each parent once per child, less the plain call the parent would make without timers (so it errs on
kvobs's side: kvobs's share errs high, not low). The journal's writer thread and kvobs's applier
thread run off the scheduler thread: their CPU is read from their thread clocks. Loaded in EngineCore
by ``benchmarks.engine_scheduler`` when ``KVOBS_BENCH_ATTRIBUTE`` is set; the CPU manager only (its
calls all run on the scheduler thread).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from kvobs.applier import THREAD_NAME as APPLIER_THREAD_NAME

ATTRIBUTE_ENV = "KVOBS_BENCH_ATTRIBUTE"
KVOBS, VLLM = 0, 1
JOURNAL_THREAD = "kvobs-journal"  # kvobs/journal.py's writer thread
APPLIER_THREAD = APPLIER_THREAD_NAME

_now = time.perf_counter_ns
_stack: list[int] = []  # per open timed span: its timed children's time so far
exclusive = [0, 0]  # ns by owner (KVOBS, VLLM)
calls = [0, 0]
_leak = 0  # ns a child's timer adds to its parent outside the child's window (calibrated)


class Timed:
    """``fn`` with its exclusive time counted for ``owner``."""

    __slots__ = ("fn", "owner")

    def __init__(self, owner: int, fn: Callable[..., Any]) -> None:
        self.fn, self.owner = fn, owner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        stack = _stack
        stack.append(0)
        started = _now()
        try:
            return self.fn(*args, **kwargs)
        finally:
            took = _now() - started
            children = stack.pop()
            exclusive[self.owner] += took - children
            calls[self.owner] += 1
            if stack:
                stack[-1] += took + _leak


def _calibrate(rounds: int = 7, n: int = 20_000) -> int:
    """The median parent exclusive time per call of an empty timer around an empty timer: the leak."""
    global _leak
    _leak = 0
    nested = Timed(KVOBS, Timed(VLLM, lambda: None))
    samples = []
    for _ in range(rounds):
        before = exclusive[KVOBS]
        for _ in range(n):
            nested()
        samples.append((exclusive[KVOBS] - before) / n)
    exclusive[:] = [0, 0]
    calls[:] = [0, 0]
    samples.sort()
    # Without timers the parent would still call the wrapped callable itself: that call is inside the
    # child's window now, so it is taken off the leak (the leak errs low: kvobs's share errs high).
    _leak = max(0, int(samples[len(samples) // 2]) - _direct_call_ns(n))
    return _leak


def _direct_call_ns(n: int) -> int:
    def empty() -> None:
        return None

    best = None
    for _ in range(5):
        started = _now()
        for _ in range(n):
            empty()
        called = _now() - started
        started = _now()
        for _ in range(n):
            pass
        looped = _now() - started
        took = max(0, called - looped) // n
        best = took if best is None else min(best, took)
    return best or 0


def journal_thread_cpu_ns() -> int:
    """CPU of kvobs's journal writer thread (0 without the journal)."""
    return thread_cpu_ns(JOURNAL_THREAD)


def applier_thread_cpu_ns() -> int:
    """CPU of kvobs's applier thread (kvobs/applier.py: the recording it takes off the scheduler thread)."""
    return thread_cpu_ns(APPLIER_THREAD)


def thread_cpu_ns(name: str) -> int:
    """CPU of the thread called ``name`` (0 if there is none)."""
    for thread in threading.enumerate():
        if thread.name == name and thread.ident is not None:
            try:
                return time.clock_gettime_ns(time.pthread_getcpuclockid(thread.ident))
            except OSError:  # the thread ended between enumerate() and here
                return 0
    return 0


def install() -> int:
    """Time kvobs's taps and what they wrap, from the next manager kvobs builds; returns the leak (ns)."""
    from kvobs.vllm import compat, manager

    build_taps, hook_policy = manager._taps, compat.hook_policy
    # The passed-through methods the flight recorder taps while it is on (compat.FLIGHT_PASS) too: timed as
    # kvobs's when kvobs put a tap there, else left as vLLM's own timed method.
    tapped = [row.name for row in compat.PROTOCOL if row.tap not in ("pass", "shutdown")] + list(compat.FLIGHT_PASS)

    def timed_taps(inner: Any, observer: Any, load_failed: Callable[..., None]) -> dict[str, Any]:
        names = [name for name in tapped if hasattr(inner, name)]
        for name in names:
            setattr(inner, name, Timed(VLLM, getattr(inner, name)))
        taps = build_taps(inner, observer, load_failed)
        return {name: Timed(KVOBS, tap) if name in names and tap is not getattr(inner, name) else tap
                for name, tap in taps.items()}

    def timed_hook_policy(cpu: Any, recorder: Any, *, stamp_inserts: bool) -> None:
        policy = compat.policy_of(cpu)
        names = [name for name in compat.POLICY_METHODS if callable(getattr(policy, name, None))]
        before = {name: getattr(policy, name) for name in names}
        for name in names:
            setattr(policy, name, Timed(VLLM, before[name]))
        hook_policy(cpu, recorder, stamp_inserts=stamp_inserts)
        for name in names:
            tap = getattr(policy, name)
            if not isinstance(tap, Timed):  # kvobs put its tap there
                setattr(policy, name, Timed(KVOBS, tap))

    manager._taps = timed_taps
    compat.hook_policy = timed_hook_policy
    return _calibrate()
