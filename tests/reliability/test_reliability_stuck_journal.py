"""A journal write that never returns (a hung file system) must not hang the engine.

The stuck file is real: the journal segment's path is a FIFO nobody reads, so the writer
thread's ``open()`` of it blocks in the kernel, holding the journal's write lock, as a write
to a hung NFS mount does. A failing load and the engine's shutdown must both still finish
within their bounds.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from kvobs.journal import FLUSH_EVERY_S
from kvobs.sinks import SHUTDOWN_WAIT_S
from tests.support.faults import observed_cpu, same_failure_as_bare


@pytest.mark.slow
def test_shutdown_is_bounded_while_the_journal_writer_is_stuck(tmp_path: Path) -> None:
    directory = tmp_path / "kvobs"
    (directory / "journal").mkdir(parents=True)
    fifo = directory / "journal" / f"e0-{os.getpid()}.000000.jsonl"
    os.mkfifo(fifo)
    manager = observed_cpu(dir=str(directory), engine="e0")
    try:
        time.sleep(FLUSH_EVERY_S * 4)  # the writer thread is now blocked opening the FIFO
        same_failure_as_bare(manager)  # the failing load: bounded by the lock timeout
        finished = threading.Event()

        def shut_down() -> None:
            manager.shutdown()
            finished.set()

        started = time.monotonic()
        threading.Thread(target=shut_down, daemon=True).start()
        bound = 3 * SHUTDOWN_WAIT_S + 2.0
        assert finished.wait(bound), f"shutdown still blocked after {bound:.0f}s by a stuck journal write"
        assert time.monotonic() - started < bound
        assert manager.observer.internal_errors["shutdown"] + manager.observer.internal_errors["journal"] >= 1
    finally:
        # Unblock the writer (open the FIFO's read end) so no thread stays stuck after the test.
        reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        time.sleep(FLUSH_EVERY_S * 2)
        os.close(reader)
