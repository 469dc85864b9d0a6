"""The engine's side of the journal: a per-engine append-only file of records in ``KVOBS_DIR``.

The records' format is ``kvobs.wire.format``, their encoders ``kvobs.wire.encode``, every reader
``kvobs.wire.decode``. Two parts here: :class:`JournalSink` (the observer's sink: the bounded queue,
the writer thread, flushes and totals) and :class:`JournalFiles` (the files: segments and their
rotation, pruning, failure reports).

Why a journal: the engine must never block on the sidecar (or on anything), one
sidecar must serve every DP rank of a node, and the evidence must outlive the
EngineCore that the failed assertion kills. So:

* the scheduler thread only appends a tuple to a bounded deque (full: the record
  is dropped and counted, never waited for); a daemon thread writes the deque
  out every ``FLUSH_EVERY_S`` with cumulative ``totals`` (exact counters even if
  batches were dropped, and nothing double counted by a restarted sidecar);
* a failed load writes its report file synchronously (temp file, fsync, rename,
  fsync of the directory) and drains the journal before the exception leaves
  kvobs: the process is about to die;
* files are bounded (``disk_bound``): ``KEEP_SEGMENTS`` segments of a quarter of the
  ``journal_bytes`` option per engine process, the newest ``journal_processes`` earlier
  processes' journals, ``max_reports`` failure reports of at most ``REPORT_BYTES`` each.

Layout: ``DIR/journal/<engine>-<pid>.<seq>.jsonl`` (``<engine>-<pid>_<n>.<seq>.jsonl`` for the
n-th other writer of the same engine in the same process and directory) and ``DIR/failures/*.json``,
directories 0700 and files 0600 (keys are hashes; no prompt text is written).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvobs import forks
from kvobs.bundles import MAX_BUNDLES, MAX_HEADER_BYTES
from kvobs.files import held, hold, keep_newest, private_dir, write_all, write_durably
from kvobs.hot_path_loader import HOT_PATH, RemovalRun
from kvobs.options import Options
from kvobs.sinks import SHUTDOWN_WAIT_S, ExceptionEvent, FailureEvent, Sink, Snapshot
from kvobs.wire.decode import report_files
from kvobs.wire.encode import (
    bounded_report,
    encode_hello,
    encode_removals,
    encode_totals,
    exception_report,
    failure_report,
)
from kvobs.wire.format import (
    FAILURES_DIR,
    JOURNAL_DIR,
    JOURNAL_SUFFIX,
    MAX_LINE_BYTES,
    Writer,
    fit_model_name,
    journal_name,
    journal_stem,
    parse_stem,
    report_name,
    report_time_ms,
    stem_of,
)

FLUSH_EVERY_S = 0.25
QUEUE_RECORDS = 65_536
KEEP_SEGMENTS = 4
REPORT_BYTES = 256 * 2**10
"""A failure report is cut to this size (its per-key list first): the disk bound counts on it."""
CHECKPOINT_BYTES = 2**20
"""Room for the sidecar's checkpoint in the same directory (a few KiB per engine)."""

def disk_bound(options: Options, engines: int = 1) -> int:
    """The most bytes a kvobs directory holds for ``engines`` engines (each restarting any number
    of times) with these options: size an ``emptyDir`` or a volume with it."""
    segment = options.journal_bytes // KEEP_SEGMENTS + MAX_LINE_BYTES  # a segment rolls after its last line
    per_engine = KEEP_SEGMENTS * segment * (1 + options.journal_processes)
    # kvobs/bundles.py: the failures' MAX_BUNDLES and each engine's requested MAX_BUNDLES, and one being written
    # into each folder by each engine (a windowless one, a header only, is answered even with the recorder off)
    window = options.flight_bytes if options.flight_window > 0 else 0
    bundles = (MAX_BUNDLES + engines * (MAX_BUNDLES + 2)) * (window + MAX_HEADER_BYTES)
    return engines * per_engine + options.max_reports * REPORT_BYTES + CHECKPOINT_BYTES + bundles


def _chunks(lines: list[str], limit: int) -> Iterator[tuple[int, bytes]]:
    """Lines joined into writes of at most ``limit`` bytes (a longer line is a write of its own),
    so no segment outgrows its bound by more than one line."""
    batch: list[bytes] = []
    size = 0
    for line in lines:
        data = line.encode() + b"\n"
        if batch and size + len(data) > limit:
            yield len(batch), b"".join(batch)
            batch, size = [], 0
        batch.append(data)
        size += len(data)
    if batch:
        yield len(batch), b"".join(batch)


_stems_in_use: set[tuple[str, str]] = set()  # (journal dir, file stem) of this process's live writers
_stems_lock = threading.Lock()


def _claim_stem(journal_dir: Path, engine: str) -> str:
    """A file stem no other live writer uses in this directory.

    Two observed managers with one engine name in one process (``observe()`` twice, with the
    default ``engine="0"``) would otherwise write, and rotate away, each other's segments; so would
    two engines with one label whose processes have the same pid in different pid namespaces (two
    containers sharing a host directory), which only the other's lock (:func:`_held`) tells apart.
    """
    with _stems_lock:
        n = 0
        stem = journal_stem(engine, os.getpid())
        while (str(journal_dir), stem) in _stems_in_use or _stem_held(journal_dir, stem):
            n += 1
            stem = journal_stem(engine, os.getpid(), n)
        _stems_in_use.add((str(journal_dir), stem))
    return stem


_hold = hold
"""Mark an open segment as its writer's while the writer lives (kvobs.files.hold: the sidecar reads it too)."""
_held = held
"""Whether a live writer holds a segment (kvobs.files.held); None when this file system cannot tell."""


def _stem_held(journal_dir: Path, stem: str) -> bool:
    return any(_held(path) for path in journal_dir.glob(f"{stem}.*{JOURNAL_SUFFIX}") if stem_of(path.name) == stem)


def announce_unobserved(options: Options, vllm_version: str, reason: str, detail: str) -> None:
    """One journal line saying an engine runs unobserved, and why (the sidecar exports it as
    ``kvobs_observing{reason} 0``). Written once, synchronously: no writer thread is started."""
    from kvobs import __version__

    assert options.dir is not None
    engine = options.engine or "0"
    journal_dir = private_dir(private_dir(Path(options.dir)) / JOURNAL_DIR)
    writer = Writer(engine, os.getpid(), os.urandom(6).hex(), fit_model_name(options.model_name or ""))
    line = encode_hello(writer, time.time(), version=__version__, vllm_version=vllm_version, history_size=0,
                        hot_path="", observing=False, reason=reason, detail=detail)
    path = journal_dir / journal_name(_claim_stem(journal_dir, engine), 0)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    try:
        _hold(fd)
        write_all(fd, (line + "\n").encode())
    except BaseException:
        os.close(fd)
        raise
    _announcements.append(fd)  # open, held, for the process's life: a live engine's line is never pruned


def dir_source(options: Options) -> str:
    """Where ``options.dir`` came from, as an operator sets it: the ``dir`` option, else env ``KVOBS_DIR``
    (kvobs.options.parse_options takes the env when the option is not given)."""
    return "env KVOBS_DIR" if options.dir is not None and options.dir == os.environ.get("KVOBS_DIR") \
        else "kvobs option 'dir'"


def unusable_dir(directory: str | os.PathLike[str]) -> str | None:
    """None when kvobs can write its files in ``directory``, else what stops it (the error, with its path).

    Found by really trying, as the journal will: the directory and its ``journal`` and ``failures`` folders
    are created 0700 (:func:`kvobs.files.private_dir`), and a temporary file is created and removed in each.
    Never raises: it runs while vLLM builds its manager."""
    try:
        root = Path(directory)
        for folder in (root, root / JOURNAL_DIR, root / FAILURES_DIR):
            private_dir(folder)
            fd, probe = tempfile.mkstemp(prefix=".kvobs-probe-", dir=folder)
            os.close(fd)
            os.unlink(probe)
    except OSError as exc:
        text = exc.strerror or str(exc) or type(exc).__name__
        return f"{type(exc).__name__}: {text}" + (f" ({exc.filename})" if exc.filename else "")
    except Exception as exc:  # a path kvobs cannot even name (an embedded NUL): unusable all the same
        return repr(exc)
    return None


DIR_LOST = ("kvobs writes no journal, no failure reports and no replay bundles for this engine (kvobs serve sees "
            "nothing of it; its kvobs_* series stay absent); the in-process failure message and span still work")
"""What an unusable directory costs (the start-up WARNING, doctor and docs/runbook.md say the same)."""


def dir_warning(options: Options, problem: str) -> str:
    """The one WARNING for an unusable directory: the option or env var, the path, the error, what is off."""
    return (f"kvobs: the directory {options.dir!r} ({dir_source(options)}) is unusable: {problem}; {DIR_LOST}. "
            "Fix or change it (kvobs doctor checks it) and restart the engine "
            "(docs/runbook.md#kvobsunavailable)")


_announcements: list[int] = []
"""The files of this process's unobserved announcements (one per manager kvobs stepped aside from)."""


def _forked() -> None:
    """In a forked child (kvobs/forks.py, after ``_stems_lock`` is renewed): the announcements are the parent's;
    the child's copies are closed, so they do not keep the parent's line "live" after it died."""
    while _announcements:
        with contextlib.suppress(OSError):
            os.close(_announcements.pop())


forks.track(sys.modules[__name__])


class ReportFiles:
    """Failure reports in ``<dir>/failures/``: written durably, each under a name used once, the newest
    ``max_reports`` kept. The journal's (:class:`JournalFiles`) and a worker-side connector's (which has no
    journal: kvobs/vllm/boundary.py) are the same code; names carry the pid, so both write side by side."""

    def __init__(self, root: Path, engine: str, max_reports: int) -> None:
        self.failures_dir = private_dir(root / FAILURES_DIR)
        self.engine = engine
        self.max_reports = max_reports
        self._written = 0

    def name(self, report: dict[str, Any]) -> str:
        """The next report's file name (each name used once), after the newest report's in the directory
        whatever the wall clock says (``kvobs.wire.format.report_name``)."""
        newest = report_files(self.failures_dir)[:1]  # any writer's: engines may share the directory
        after = report_time_ms(newest[0].stem) if newest else None
        name = report_name(report["time"], self.engine, os.getpid(), self._written, -1 if after is None else after)
        self._written += 1
        return name

    def write(self, name: str, report: dict[str, Any]) -> None:
        """Write a report durably (cut to ``REPORT_BYTES``), then drop the oldest beyond ``max_reports``."""
        write_durably(self.failures_dir / name, bounded_report(report, REPORT_BYTES))
        keep_newest(report_files(self.failures_dir), self.max_reports)  # only kvobs's own (the readers' rule)


class JournalFiles:
    """The journal's files for one writer: its segments (appended, rolled at ``segment_bytes``, the
    newest ``KEEP_SEGMENTS`` kept), the pruning of this engine's earlier processes' segments, and its
    failure reports (written durably, the newest ``max_reports`` kept). Knows nothing of queues or
    threads: :class:`JournalSink` calls it under its write lock (reports: on the failing thread)."""

    def __init__(self, directory: str | os.PathLike[str], engine: str, options: Options) -> None:
        self.root = private_dir(Path(directory))
        self.journal_dir = private_dir(self.root / JOURNAL_DIR)
        self.reports = ReportFiles(self.root, engine, options.max_reports)
        self.engine = engine
        self.segment_bytes = options.journal_bytes // KEEP_SEGMENTS
        self.keep_processes = options.journal_processes
        self._seq = 0
        self._segment_bytes = 0
        self._fd: int | None = None
        self.lines_kept = 0
        """Whole lines of the last failed :meth:`write` that were written and kept."""
        self._stem = _claim_stem(self.journal_dir, engine)
        self._prune_earlier_processes()

    # -- segments ----------------------------------------------------------------------

    def write(self, data: bytes) -> None:
        """Append ``data`` (whole lines) to the current segment, rolling first when it would not fit."""
        self.lines_kept = 0
        if self._fd is None or self._segment_bytes + len(data) > self.segment_bytes:
            self._roll()
        fd = self._fd
        assert fd is not None
        start = os.fstat(fd).st_size  # the file's real end: an operator's truncate may have cut it
        view, done = memoryview(data), 0
        try:
            while done < len(data):  # a nearly full disk writes short before it fails
                done += os.write(fd, view[done:])
        except OSError:
            # Keep the file line-aligned: cut a partial line back off (disk full, EIO). Whole lines
            # already out stay: a reader may have read them, and a file cut back under its position
            # would cost it its place (issue 31, class 4).
            kept = data.rfind(b"\n", 0, done) + 1
            self.lines_kept = data.count(b"\n", 0, kept)
            with contextlib.suppress(OSError):
                os.ftruncate(fd, start + kept)
            raise
        self._segment_bytes += len(data)

    def forget_segment(self) -> None:
        """In a forked child: close this process's copy of the parent's open segment, unwritten. Closing never
        drops the ``flock`` the parent holds through its own copy; keeping it would keep the segment "held"
        after the parent died."""
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def sync(self) -> None:
        """fsync the current segment (if one is open)."""
        if self._fd is not None:
            os.fsync(self._fd)

    def close(self) -> None:
        """Close the current segment and give the file stem back."""
        try:
            if self._fd is not None:
                fd, self._fd = self._fd, None
                os.close(fd)
        finally:
            with _stems_lock:
                _stems_in_use.discard((str(self.journal_dir), self._stem))

    def _roll(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None  # never keep a closed descriptor number (it gets reused)
            os.close(fd)
            self._seq += 1
        path = self.journal_dir / journal_name(self._stem, self._seq)
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        _hold(self._fd)
        self._segment_bytes = 0
        old = self._seq - KEEP_SEGMENTS
        if old >= 0:
            with contextlib.suppress(FileNotFoundError):
                (self.journal_dir / journal_name(self._stem, old)).unlink()

    def _prune_earlier_processes(self) -> None:
        """Delete the segments of this engine's earlier processes but the newest ``journal_processes``'.

        Each process bounds its own segments; without this a crash-looping engine would leave
        up to KEEP_SEGMENTS segments per restart, forever. A live writer is never among the deleted
        nor counted as an earlier process: it holds a lock on its open segment (:func:`_hold`) that
        only its death releases, so another engine with the same label in the same directory (two
        models on one node, both engine "0") keeps its journal (issue 31, class 3). Where the file
        system cannot tell, the newest by last write are kept (a live writer writes its totals every
        FLUSH_EVERY_S).
        """
        mine = os.getpid()
        by_pid: dict[int, list[Path]] = {}
        for path in self.journal_dir.glob("*" + JOURNAL_SUFFIX):
            parsed = parse_stem(stem_of(path.name))
            if parsed is not None and parsed[0] == self.engine and parsed[1] != mine:
                by_pid.setdefault(parsed[1], []).append(path)
        earlier = [paths for paths in by_pid.values() if not any(_held(path) for path in paths)]
        if len(earlier) <= self.keep_processes:
            return

        def last_write(paths: list[Path]) -> float:
            newest = 0.0
            for path in paths:
                with contextlib.suppress(OSError):
                    newest = max(newest, path.stat().st_mtime)
            return newest

        by_age = sorted(earlier, key=last_write)
        for paths in by_age[: len(by_age) - self.keep_processes]:
            for path in paths:
                with contextlib.suppress(OSError):
                    path.unlink()


class JournalSink(Sink):
    """Queues an engine's records for the sidecar and writes them out on its own thread, through
    :class:`JournalFiles`; see the module docstring."""

    stage = "journal"
    needs_residency = True

    def __init__(self, directory: str | os.PathLike[str], options: Options, vllm_version: str = "") -> None:
        self.engine = options.engine or "0"
        self.files = JournalFiles(directory, self.engine, options)
        # Tells this writer's cumulative totals apart from any other's with the same engine and
        # pid: a restarted container reuses pids; two observed managers may share one process.
        self.run = os.urandom(6).hex()
        # Fitted to what the sidecar reads (a model path may be longer than a label it takes).
        self.writer = Writer(self.engine, os.getpid(), self.run, fit_model_name(options.model_name or ""))
        self._snapshot: Snapshot | None = None  # the latest the observer pushed (Observer.drain)
        self._queue: deque[tuple[Any, ...]] = deque()
        self._queued = 0  # records in the queue (a run of batches counts each batch)
        self._limit = QUEUE_RECORDS  # -1 in a forked child: every record dropped, counted (_forked)
        self.dropped = 0
        self.forked_from: int | None = None
        """In a child forked from the engine, the parent's pid: this sink writes nothing there (:meth:`_forked`)."""
        self._write_lock = threading.Lock()
        self._wall_offset = time.time() - time.monotonic()
        self._totals_seq = itertools.count(1)  # next() is atomic: two flushing threads never share one
        self.writer_cpu_s = 0.0
        """CPU seconds the writer thread has spent (the overhead benchmark adds it to the engine's)."""
        self._closed = threading.Event()
        self.between_flushes: Callable[[], None] | None = None
        """Called by the writer thread after each flush (kvobs.replay_requests.Answerer.poll: on-demand replay
        bundles are written here, off the scheduler thread); its faults count under stage "flight"."""
        from kvobs import __version__

        self._enqueue(("line", encode_hello(
            self.writer, time.time(), version=__version__, vllm_version=vllm_version,
            history_size=options.history_size, hot_path=HOT_PATH,
        )))
        self._thread = threading.Thread(target=self._run, name="kvobs-journal", daemon=True)
        self._thread.start()
        forks.track(self)

    def _forked(self) -> None:
        """In a child forked from the engine (kvobs/forks.py renewed the locks first). The child is not this
        journal's writer: its files carry the parent's pid and run, so lines from the child would be read as
        the parent's (its counters, its failures). The parent writes what was queued (dropped here, counted),
        the writer thread is not restarted, the child's copy of the open segment is closed (the shared
        ``flock`` stays the parent's: kvobs.files.hold), and every record and failure report from now on is
        dropped and counted. A child meant as an engine builds its own manager: a journal under its own pid."""
        self.forked_from = os.getppid()
        self.dropped += self._queued
        self._queue.clear()
        self._queued = 0
        self._limit = -1
        self._closed.set()
        self.between_flushes = None
        self.files.forget_segment()

    # -- scheduler thread: O(1), never blocks ---------------------------------------

    def _enqueue(self, record: tuple[Any, ...], batches: int = 1) -> None:
        if self._queued + batches > self._limit:
            self.dropped += batches
            return
        self._queued += batches
        self._queue.append(record)

    def on_removals(self, run: RemovalRun) -> None:
        """A drained run of batches, queued as one item: encoded on the writer thread."""
        self._enqueue(("removals", run), len(run.reqs))

    def on_failure(self, event: FailureEvent) -> None:
        """Durable report (naming the failure's trace, when the event carries one), then a bounded
        synchronous drain of the journal."""
        if self.forked_from is not None:  # a forked child writes nothing of its own in the parent's name
            self.dropped += 1
            return
        self._write_failure(failure_report(event.diagnosis, event.exc, self.writer, time.time(), trace=event.trace),
                            event.remaining())

    def on_exception(self, event: ExceptionEvent) -> None:
        """An exception at the connector's boundary: its report, durably, then the journal drained (bounded)."""
        if self.forked_from is not None:
            self.dropped += 1
            return
        self._write_failure(exception_report(event.failure, event.exc, self.writer, time.time(), trace=event.trace),
                            event.remaining())

    def _write_failure(self, report: dict[str, Any], remaining: float) -> None:
        name = self.files.reports.name(report)
        try:
            self.files.reports.write(name, report)
        except Exception as fault:  # the journal (with the failure in its totals) still gets flushed
            self.fault("report", fault)
        try:  # the observer pushed the counters with the failure in them (Observer.publish_failure)
            self.flush(timeout=remaining, durable=True)
        except Exception as fault:
            self.fault("journal", fault)

    # -- writer ------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._closed.wait(FLUSH_EVERY_S):
            started = time.thread_time()
            try:
                self.flush()
            except Exception as exc:  # never kill the thread; counted
                self.fault("journal", exc)
            if self.between_flushes is not None:
                try:
                    self.between_flushes()
                except Exception as exc:
                    self.fault("flight", exc)
            self.writer_cpu_s += time.thread_time() - started

    def on_snapshot(self, snapshot: Snapshot) -> None:
        self._snapshot = snapshot

    def _totals(self) -> str:
        """The totals line of the latest snapshot, with the count this sink keeps itself (its drops)."""
        snapshot = self._snapshot
        counters = {} if snapshot is None else dict(snapshot.counters)  # the snapshot's maps are its own copies
        counters["dropped"] = {**counters.get("dropped", {}), "journal": self.dropped}
        return encode_totals(
            self.writer, time.time(), counters,
            history_keys=0 if snapshot is None else snapshot.history_keys,
            history_window_s=0.0 if snapshot is None else snapshot.history_window_s, seq=next(self._totals_seq),
        )

    def flush(self, timeout: float = -1, durable: bool = False) -> bool:
        """Write out what is queued plus the totals of the latest :class:`Snapshot` the observer pushed (at the
        end of each drain that changed them, and at least every ``SNAPSHOT_EVERY_S``: ``Observer.drain``; the
        journal never calls into the observer); False if the lock was not had in time.
        In a forked child nothing is written (:meth:`_forked`).
        """
        if self.forked_from is not None:
            return True
        totals = self._totals()
        if not self._write_lock.acquire(timeout=timeout):
            return False
        try:
            lines: list[str] = []
            while self._queue:
                item = self._queue.popleft()
                if item[0] == "removals":
                    self._queued -= len(item[1].reqs)
                    lines.extend(encode_removals(self.writer, item[1], self._wall_offset))
                else:
                    self._queued -= 1
                    lines.append(item[1])
            lines.append(totals)
            written = 0
            try:
                for count, chunk in _chunks(lines, self.files.segment_bytes):
                    self.files.write(chunk)
                    written += count
            except OSError:
                # Lost, and said so: counted as dropped (the next totals carry the count;
                # the counters themselves are cumulative, so they recover exactly).
                self.dropped += max(0, len(lines) - 1 - written - self.files.lines_kept)
                raise
            if durable:
                self.files.sync()
            return True
        finally:
            self._write_lock.release()

    def close(self) -> None:
        """Flush and close, bounded: a writer stuck in a hung write must not hang the engine's shutdown."""
        self._closed.set()
        self._thread.join(timeout=SHUTDOWN_WAIT_S)
        if not self.flush(timeout=SHUTDOWN_WAIT_S, durable=True):
            raise TimeoutError(f"journal writer stuck for over {SHUTDOWN_WAIT_S}s; not flushed at close")
        if not self._write_lock.acquire(timeout=SHUTDOWN_WAIT_S):
            raise TimeoutError("journal writer stuck; file left open at close")
        try:
            self.files.close()
        finally:
            self._write_lock.release()
