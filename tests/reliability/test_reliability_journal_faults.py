"""The kvobs directory unwritable or full, for real (a path under a regular file, a read-only
and a tiny tmpfs mount): vLLM behaves as bare, only vLLM's assertion escapes, kvobs counts and
logs its fault once, and what the journal did write stays exact (the sidecar's totals equal the
engine's once the disk is back; a failed append is cut off, so no corrupt line is left).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

import pytest

from kvobs.journal import FLUSH_EVERY_S
from tests.support.faults import churn, engine_totals, observed_cpu, remount, same_failure_as_bare, tmpfs


def kvobs_error_logs(caplog: pytest.LogCaptureFixture, stage: str) -> int:
    return sum(1 for r in caplog.records if r.name == "kvobs" and f"internal error in {stage}" in r.getMessage())


def wait_flushed() -> None:
    time.sleep(FLUSH_EVERY_S * 3)


@pytest.mark.parametrize("where", ["under-a-regular-file", "read-only-mount"])
def test_an_unwritable_directory_does_not_stop_the_engine(
    where: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with contextlib.ExitStack() as stack:
        if where == "read-only-mount":
            mount = stack.enter_context(tmpfs(tmp_path / "mnt"))
            remount(mount, "ro")
            directory = mount / "kvobs"
        else:
            blocker = tmp_path / "not-a-dir"
            blocker.write_text("x")
            directory = blocker / "kvobs"
        stack.enter_context(caplog.at_level(logging.WARNING, logger="kvobs"))
        manager = observed_cpu(dir=str(directory), engine="e0")
        try:
            churn(manager, 5)
            same_failure_as_bare(manager, rounds=2)
            obs = manager.observer
            assert obs.internal_errors["journal"] == 1  # at start-up, once
            # The in-process evidence is whole: 4 rounds evicted 4 each, each failing sequence 8.
            assert obs.evicted["capacity"] == 4 * 4 + 2 * 8 and obs.failures["evicted_after_lookup"] == 2
        finally:
            manager.shutdown()
        # Said once, as a WARNING naming the path and what is off (issue 41), not as a kvobs fault.
        assert kvobs_error_logs(caplog, "journal") == 0
        warnings = [r.getMessage() for r in caplog.records if r.name == "kvobs" and r.levelno == logging.WARNING]
        assert len(warnings) == 1 and f"the directory {str(directory)!r} (kvobs option 'dir') is unusable" \
            in warnings[0], warnings
        assert not directory.exists()


def test_failures_directory_turning_unwritable_mid_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """As root, chmod does not stop writes and a file system with open files cannot be remounted
    read-only; so the failures directory is replaced by a regular file under the running engine."""
    directory = tmp_path / "kvobs"
    with caplog.at_level(logging.ERROR, logger="kvobs"):
        manager = observed_cpu(dir=str(directory), engine="e0")
        try:
            churn(manager, 10)
            failures = directory / "failures"
            failures.rmdir()
            failures.write_text("in the way")
            same_failure_as_bare(manager, rounds=2)  # no report can be written: the assertion is still vLLM's
            obs = manager.observer
            assert obs.internal_errors["report"] == 2
            churn(manager, 10, start=10)
            wait_flushed()
        finally:
            manager.shutdown()
    assert kvobs_error_logs(caplog, "report") == 1
    totals = engine_totals(directory, "e0")  # the journal still carried everything (zero counts are not written)
    assert totals["evicted"] == dict(+obs.evicted) and totals["batches"] == dict(+obs.batches)
    assert totals["failures"] == dict(+obs.failures) and totals["failures"]["evicted_after_lookup"] == 2
    assert totals["corrupt"]["lines"] == 0
    assert (directory / "failures").read_text() == "in the way"
    # What the sidecar exports: the failures counted, the report-stage errors KvobsFailureReportLost
    # reads, and failure-time gauges (from reports) still 0, so KvobsLoadFailure cannot see them.
    from prometheus_client.core import CollectorRegistry
    from prometheus_client.exposition import generate_latest

    from kvobs.sidecar.ingest import Ingest
    from kvobs.sidecar.metrics import KvobsCollector

    ingest = Ingest(directory)
    ingest.poll()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(KvobsCollector(ingest))
    text = generate_latest(registry).decode()
    engine = 'engine="e0",model_name=""'
    assert f'kvobs_load_failures_total{{cause="evicted_after_lookup",{engine}}} 2.0' in text
    assert f'kvobs_internal_errors_total{{{engine},stage="report"}} 2.0' in text
    assert f'kvobs_last_load_failure_timestamp_seconds{{cause="evicted_after_lookup",{engine}}} 0.0' in text


def test_directory_full(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with tmpfs(tmp_path / "mnt", size="256k") as mount, caplog.at_level(logging.ERROR, logger="kvobs"):
        directory = mount / "kvobs"
        manager = observed_cpu(dir=str(directory), engine="e0")
        filler = mount / "filler"
        try:
            churn(manager, 10)
            wait_flushed()
            fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
            try:  # fill the file system to the last byte
                for size in (65536, 4096, 512, 1):
                    with contextlib.suppress(OSError):
                        while os.write(fd, b"\0" * size):
                            pass
            finally:
                os.close(fd)
            churn(manager, 200, start=10)  # batch records that no longer fit
            same_failure_as_bare(manager)
            wait_flushed()
            obs = manager.observer
            assert obs.internal_errors["journal"] >= 1 and obs.internal_errors["report"] == 1
            sizes = {p.name: p.stat().st_size for p in (directory / "journal").iterdir()}
            filler.unlink()
            churn(manager, 10, start=210)
            wait_flushed()
        finally:
            manager.shutdown()
        assert kvobs_error_logs(caplog, "journal") == 1
        leftovers = [p.name for p in (directory / "failures").iterdir()]
        assert leftovers == [], leftovers  # no half-written report or temp file left behind
        totals = engine_totals(directory, "e0")
        assert totals["evicted"] == dict(+obs.evicted) and totals["failures"] == dict(+obs.failures)
        assert totals["dropped"]["journal"] > 0
        assert totals["corrupt"]["lines"] == 0, sizes  # partial appends were cut off
        for path in (directory / "journal").iterdir():
            assert path.read_bytes().endswith(b"\n")
        assert os.stat(directory).st_mode & 0o077 == 0
