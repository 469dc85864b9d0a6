"""Fork (issue 43, item 4): a child forked while another thread holds any lock kvobs owns still works.

A fork copies only the forking thread, so a lock held by another thread at that moment stays held in
the child for ever. kvobs renews every lock, condition and event it owns in the child (kvobs/forks.py).
Each test forks a process observing vLLM's real CPU manager; the child reads the evidence, makes
manager calls and fails a load (vLLM's real ``Chunk ... not found in cache`` assertion, with kvobs's
explanation), and exits with a status the parent checks. A child that hangs is killed after
``CHILD_TIMEOUT_S`` and the test fails: it never hangs the suite.

The locks are enumerated from kvobs's registry (``kvobs.forks.owned``), so a lock a tracked class gains
later is covered without naming it here. Before the fix the child hung at its first read of the
evidence with the observer's drain lock held by another thread (``Observer.totals`` -> ``drain``).
"""

from __future__ import annotations

import functools
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvobs import forks
from kvobs.journal import JournalSink
from kvobs.observer import Observer
from kvobs.vllm import ObservedOffloadingManager
from kvobs.wire.format import journal_stem
from tests.support.causes import ctx, failed_load, observed, store
from tests.support.vllm_env import cpu_extra, key, set_position

CHILD_TIMEOUT_S = 15.0
"""A child still running after this is hung: killed, and the test fails."""
CHILD_WORK_S = 5.0
"""What the child's work may take at most (it takes milliseconds)."""

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # 3.12+: fork() of a threaded process


def store_pairs(manager: ObservedOffloadingManager, keys: list[bytes], context: Any) -> None:
    """Store ``keys`` two at a time (a 4-chunk tier takes no more at once), evicting the oldest."""
    for i in range(0, len(keys), 2):
        store(manager, keys[i:i + 2], context)


def evidence(managers: list, directory: Path | None, **more: Any) -> tuple[ObservedOffloadingManager, Any]:
    """An observed 4-chunk CPU manager with evictions recorded, and a request whose lookup reported key 5."""
    options: dict[str, Any] = more if directory is None else {"dir": str(directory), **more}
    manager = observed(managers, cpu_extra(4), **options)
    writer = ctx(manager, "writer")
    store_pairs(manager, [key(i) for i in range(6)], writer)
    victim = ctx(manager, "victim")
    set_position(victim, key(5), 96)
    assert manager.lookup(key(5), victim).name == "HIT"
    manager.observer.drain()
    return manager, victim


def child_work(manager: ObservedOffloadingManager, victim: Any, own_dir: Path | None = None) -> None:
    """What the child must be able to do: read the evidence, call the manager, fail a load; with ``own_dir``,
    also observe a manager of its own there (a journal, a failure report and a replay bundle under its pid:
    the module-level locks and the applier's)."""
    observer = manager.observer
    before = observer.totals()  # the first read of the evidence: drains under the drain lock
    assert observer.evicted["capacity"] >= 2, before
    writer = ctx(manager, "child-writer")
    store_pairs(manager, [key(50 + i) for i in range(4)], writer)  # evicts key 5: the recorder's lock, the queue
    match = failed_load(manager, [key(5)], victim)  # kvobs's explanation of vLLM's assertion
    assert match["cause"] == "evicted_after_lookup", match.group(0)
    after = observer.totals()
    assert after["failures"]["evicted_after_lookup"] == before["failures"]["evicted_after_lookup"] + 1
    assert after["evicted"]["capacity"] > before["evicted"]["capacity"]
    assert not +observer.internal_errors, observer.internal_errors
    if own_dir is not None:
        own_manager_work(own_dir)


def own_manager_work(own_dir: Path) -> None:
    """In the child: a manager of its own, observed with ``own_dir``, writes its journal, a failure report and
    a replay bundle under the child's pid (kvobs.journal's and the flight recorder's module locks, the applier's)."""
    managers: list = []
    own, own_victim = evidence(managers, own_dir, flight_calls=1000)
    try:
        store_pairs(own, [key(60 + i) for i in range(4)], ctx(own, "own-writer"))
        assert failed_load(own, [key(5)], own_victim)["cause"] == "evicted_after_lookup"
    finally:
        own.shutdown()
    pid = os.getpid()
    assert [p for p in journal_files(own_dir) if p.name.startswith(journal_stem("0", pid) + ".")]
    assert [p.name for p in (own_dir / "failures").iterdir() if f"-0-{pid}-" in p.name]
    assert [p.name for p in (own_dir / "replay").iterdir() if f"-0-{pid}-" in p.name]


def in_child(work: Callable[[], None], report: Path) -> None:
    """Run ``work`` in the forked child and leave with its status; never returns into pytest."""
    status = 1
    try:
        started = time.monotonic()
        work()
        took = time.monotonic() - started
        status = 0 if took < CHILD_WORK_S else 3
        report.write_text(f"took {took:.3f}s")
    except BaseException:
        report.write_text(traceback.format_exc())
    finally:
        os._exit(status)


def fork_and_wait(work: Callable[[], None], report: Path) -> str | None:
    """Fork, run ``work`` in the child, wait for it (killed after ``CHILD_TIMEOUT_S``): None when it
    exited 0, else what went wrong."""
    pid = os.fork()
    if pid == 0:
        in_child(work, report)
    deadline = time.monotonic() + CHILD_TIMEOUT_S
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            code = os.waitstatus_to_exitcode(status)
            text = report.read_text() if report.exists() else ""
            return None if code == 0 else f"exit {code}: {text}"
        time.sleep(0.02)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return f"hung: killed after {CHILD_TIMEOUT_S}s"


def hold(value: Any, held: threading.Event, release: threading.Event) -> None:
    """Hold ``value`` (a lock, an RLock, a condition's lock, an event's condition) until ``release``."""
    lock = value._cond if isinstance(value, threading.Event) else value
    with lock:
        held.set()
        release.wait(CHILD_TIMEOUT_S * 2)


def locks_of(observer: Observer) -> list[tuple[str, Any, str, Any]]:
    """Every lock kvobs owns in this process that ``observer``'s engine can meet: the registry's, less those of
    other tests' observers (their recorders and sinks)."""
    others: set[int] = set()
    mine = {id(observer), id(observer.recorder), *(id(sink) for sink in observer.sinks)}
    for _, holder, _, _ in forks.owned():
        if isinstance(holder, Observer) and holder is not observer:
            others |= {id(holder), id(holder.recorder), *(id(sink) for sink in holder.sinks)}
    return [item for item in forks.owned() if id(item[1]) in mine or id(item[1]) not in others]


def test_a_child_forked_while_any_kvobs_lock_is_held_reads_calls_and_fails_a_load(tmp_path: Path) -> None:
    managers: list = []
    manager, victim = evidence(managers, tmp_path / "dir")
    try:
        owned = locks_of(manager.observer)
        names = {f"{label}.{name}" for label, _, name, _ in owned}
        # The registry sees the locks this issue is about (and whatever a tracked class adds later).
        assert {"Observer._drain_lock", "Observer.recorder._lock", "Applier._lock", "Applier._wake",
                "JournalSink._write_lock", "JournalSink._closed", "kvobs.journal._stems_lock"} <= names, names
        problems: dict[str, str] = {}
        for i, (label, holder, name, _) in enumerate(owned):
            value = getattr(holder, name)  # now: an earlier child's renewal never touched the parent's
            held, release = threading.Event(), threading.Event()
            holder_thread = threading.Thread(target=hold, args=(value, held, release), name="kvobs-test-holder")
            holder_thread.start()
            try:
                assert held.wait(5), f"{label}.{name} could not be taken"
                work = functools.partial(child_work, manager, victim, tmp_path / f"child-{i}")
                problem = fork_and_wait(work, tmp_path / f"child-{i}.txt")
            finally:
                release.set()
                holder_thread.join(5)
            if problem is not None:
                problems[f"{label}.{name}"] = problem
        assert not problems, problems
        # The parent goes on as before: its evidence and its load failure too.
        obs = manager.observer
        assert obs.totals()["failures"]["evicted_after_lookup"] == 0
        store_pairs(manager, [key(70 + i) for i in range(4)], ctx(manager, "parent-writer"))
        assert failed_load(manager, [key(5)], victim)["cause"] == "evicted_after_lookup"
    finally:
        for m in managers:
            m.shutdown()


def journal_files(directory: Path) -> list[Path]:
    return sorted((directory / "journal").glob("*.jsonl"))


def test_a_forked_child_writes_nothing_in_the_parents_name_and_a_new_manager_its_own_journal(tmp_path: Path) -> None:
    """docs/design.md, "Fork": the child's copy of the journal sink drops (and counts) what the parent had
    queued and everything after, writes no line, report or bundle; a manager the child builds writes its own
    journal under the child's pid."""
    directory = tmp_path / "dir"
    managers: list = []
    manager, victim = evidence(managers, directory)
    parent = os.getpid()
    try:
        sink = next(s for s in manager.observer.sinks if isinstance(s, JournalSink))
        assert sink.flush(timeout=5)
        written = {path: path.read_bytes() for path in journal_files(directory)}
        assert written and all(path.name.startswith(journal_stem("0", parent)) for path in written)
        store(manager, [key(20 + i) for i in range(2)], ctx(manager, "queued"))  # queued, not yet written
        with sink._write_lock:  # the writer thread cannot write them before the fork
            manager.observer.drain()
            queued = sink._queued
            assert queued > 0

            def child() -> None:
                assert sink.forked_from == parent == manager.observer.forked_from
                assert sink.dropped == queued, (sink.dropped, queued)  # the parent's, left to the parent
                child_work(manager, victim)
                assert sink.dropped > queued  # the child's removals and its failure report: counted, not written
                assert sink.flush(timeout=1)  # writes nothing, and never waits
                assert not (directory / "failures").exists() or not list((directory / "failures").iterdir())
                for path, data in written.items():  # the parent's files, as the parent left them
                    assert path.read_bytes() == data, path
                assert not (directory / "replay").exists() or not list((directory / "replay").glob("*.*"))
                own_manager_work(directory)  # a manager of the child's own: its pid, its files, beside the parent's
                manager.shutdown()  # the inherited one closes without its (absent) writer thread, writing nothing
                assert sink.files._fd is None

            problem = fork_and_wait(child, tmp_path / "child.txt")
        assert problem is None, problem
        assert sink.flush(timeout=5)  # the parent writes what it had queued
        assert sink.dropped == 0
        reports = [p.name for p in (directory / "failures").iterdir()]
        assert len(reports) == 1 and f"-0-{parent}-" not in reports[0], reports  # the child's own manager's
    finally:
        for m in managers:
            m.shutdown()
