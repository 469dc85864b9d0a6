"""Follow every engine's journal files and failure reports in a kvobs directory.

Picks up engines that start later (new files), keeps what it has when they die, forgets
the position of rotated-away files, and checkpoints its state (with every file position)
atomically, so a restart neither loses nor double counts. One file it cannot read (another
uid's, a symlink, a damaged report) is skipped, counted by source and reason, and named
once in the log; the others are read as usual. Each report read is logged once as a structured
line (``kvobs.sidecar.logs.FailureLines``), and a round that read one checkpoints at once, so a
restarted sidecar does not log it again.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from pathlib import Path

from kvobs.files import private_dir, write_durably
from kvobs.sidecar.logs import FailureLines
from kvobs.sidecar.state import SidecarState, load_checkpoint
from kvobs.wire.decode import JournalPosition, list_reports, read_new_records, read_report
from kvobs.wire.format import FAILURES_DIR, JOURNAL_DIR, JOURNAL_SUFFIX, stem_of

logger = logging.getLogger("kvobs.sidecar")

CHECKPOINT = "sidecar-state.json"
POLL_S = 0.5
ROUND_BYTES = 8 * 2**20  # per journal file and round
SLICE_BYTES = 2**20  # folded under the lock at once
CHECKPOINT_EVERY_S = 5.0
MAX_NAMED_FILES = 1_000  # files whose skip was logged (each is logged once)
MAX_UNREADABLE = 1_000
"""Paths kept in ``Ingest.unreadable`` at most (a directory of another uid's files stays bounded)."""


def _check_listable(directory: Path) -> None:
    """OSError if ``directory`` exists but cannot be listed (another uid's 0700 directory)."""
    try:
        with os.scandir(directory):
            pass
    except FileNotFoundError:
        return


class Ingest:
    """Folds new records into ``state`` under ``lock``; call ``poll()`` or ``run()``."""

    def __init__(self, directory: Path) -> None:
        self.dir = private_dir(directory)
        self.checkpoint_path = self.dir / CHECKPOINT
        self.lock = threading.Lock()
        self.errors = 0
        self._named: set[str] = set()
        self.unreadable: dict[str, str] = {}
        """Path -> why the sidecar cannot read (or write) it now: /healthz lists them, a gauge counts them."""
        restored: SidecarState | None = None
        try:
            restored = load_checkpoint(self.checkpoint_path)
        except OSError as exc:  # another uid's checkpoint: unreadable (a uid mismatch), not damage
            logger.error("kvobs sidecar: cannot read checkpoint %s (%s); starting afresh", self.checkpoint_path, exc)
            restored = SidecarState()
            restored.skipped["checkpoint", "unreadable"] += 1
            self._unreadable(self.checkpoint_path, exc)
        except ValueError as exc:
            logger.error("kvobs sidecar: ignoring checkpoint %s it cannot trust (%s); starting afresh",
                         self.checkpoint_path, exc)
            restored = SidecarState()
            restored.skipped["checkpoint", "corrupt"] += 1
        self.state = restored or SidecarState()
        self.failure_lines = FailureLines(logger)
        self.last_poll = 0.0
        self._last_checkpoint = time.monotonic()
        self._stop = threading.Event()

    def _unreadable(self, path: Path, detail: object) -> None:
        """Remember that ``path`` cannot be read now (bounded), for /healthz and the unreadable-files gauge."""
        if str(path) in self.unreadable or len(self.unreadable) < MAX_UNREADABLE:
            self.unreadable[str(path)] = str(getattr(detail, "strerror", None) or detail)

    def _skip(self, source: str, reason: str, path: Path, detail: object) -> None:
        """Count a file or record that cannot be read (under the lock); name the file in the log once."""
        self.state.skipped[source, reason] += 1
        if reason == "unreadable":
            self._unreadable(path, detail)
        if path.name not in self._named and len(self._named) < MAX_NAMED_FILES:
            self._named.add(path.name)
            logger.warning("kvobs sidecar: skipping %s %s (%s): %s", source, path, reason, detail)

    def poll(self) -> None:
        """Read whatever is new; checkpoint when due.

        Lines are read and parsed outside the lock and folded under it in slices of at
        most ``SLICE_BYTES`` (each slice with its file position, so a checkpoint never sees
        records without their position): a scrape waits for one slice, not a whole round.
        """
        journal_dir = self.dir / JOURNAL_DIR
        try:
            _check_listable(journal_dir)  # glob() would hide an unreadable directory as an empty one
            files = sorted(journal_dir.glob("*" + JOURNAL_SUFFIX)) if journal_dir.is_dir() else []
            with self.lock:
                self.unreadable.pop(str(journal_dir), None)
        except OSError as exc:
            files = []
            with self.lock:
                self._skip("journal", "unreadable", journal_dir, exc)
        with self.lock:
            state = self.state
            present = {f.name for f in files}
            for name in [n for n in state.positions if n not in present]:
                del state.positions[name]  # rotated away or removed
            positions = {f.name: state.positions.get(f.name, (0, False)) for f in files}
            state.retire_writers({stem_of(name) for name in present})
        for path in files:
            if self._stop.is_set():  # stopping: the exit checkpoint must not wait for a long round (serve's join)
                break
            self._read_journal(path, *positions[path.name])
        with self.lock:
            new_reports = self._read_reports()
            self.last_poll = time.time()
        self.failure_lines.write()  # outside the lock: a slow log pipe never holds up a scrape
        # A report's line is logged once: its name is in the checkpoint as soon as the line is out.
        if new_reports or time.monotonic() - self._last_checkpoint >= CHECKPOINT_EVERY_S:
            self.checkpoint()

    def _read_journal(self, path: Path, offset: int, skipping: bool) -> None:
        stem = stem_of(path.name)
        given_up = offset < 0  # unreadable last time: tried again quietly, read from the start if it now is
        if given_up:
            offset, skipping = 0, False
        budget = ROUND_BYTES
        while budget > 0:
            position = JournalPosition(offset, skipping)
            try:
                records = list(read_new_records(path, position, min(SLICE_BYTES, budget)))
                if position.offset == offset and budget > SLICE_BYTES:  # a line longer than a slice
                    records = list(read_new_records(path, position, budget))
            except FileNotFoundError:
                with self.lock:
                    self.unreadable.pop(str(path), None)
                return
            except OSError as exc:  # another uid's file, a symlink, a FIFO: skipped, the others go on
                if not given_up:
                    with self.lock:
                        self.state.positions[path.name] = (-1, False)  # -1: unreadable, counted once
                        self._skip("journal", "unreadable", path, exc)
                return
            if given_up:
                with self.lock:
                    self.unreadable.pop(str(path), None)
                given_up = False
            if position.rewound:  # copy-truncate rotation or a truncate: its later lines are read (issue 31)
                logger.warning("kvobs sidecar: journal %s was cut back under the reader (copy-truncate "
                               "rotation or a truncate); reading it again from its start", path)
                budget -= position.offset
            elif position.offset == offset and position.skipping == skipping:
                return
            else:
                budget -= position.offset - offset
            offset, skipping = position.offset, position.skipping
            with self.lock:
                for record in records:
                    if record is None:
                        self._skip("journal", "corrupt", path, "a line that is not a kvobs record")
                    else:
                        self.state.apply(record, stem)
                self.state.positions[path.name] = (offset, skipping)
            time.sleep(0)  # hand the GIL to a waiting scrape between slices

    def _read_reports(self) -> int:
        """Fold the reports not read yet, taking each one's line (FailureLines); how many were folded."""
        state = self.state
        folded = 0
        listed = False
        try:
            _check_listable(self.dir / FAILURES_DIR)  # list_reports() would hide it as an empty directory
            self.unreadable.pop(str(self.dir / FAILURES_DIR), None)
            listed = True
        except OSError as exc:
            self._unreadable(self.dir / FAILURES_DIR, exc)
        paths, strays = list_reports(self.dir / FAILURES_DIR)
        if listed:  # bounded: forget the reports the engines pruned (a name never comes back: time, pid, n)
            state.reports_seen &= {p.stem for p in paths} | {p.name for p in paths} | {p.name for p in strays}
        for path in strays:
            if path.name not in state.reports_seen:
                state.reports_seen.add(path.name)
                self._skip("report", "corrupt", path, "not a kvobs report: kvobs names them <15-digit ms time>-"
                           "<engine>-<pid>-<n>.json")
        present = {str(path) for path in paths}
        for name in [n for n in self.unreadable if f"/{FAILURES_DIR}/" in n and n not in present]:
            del self.unreadable[name]  # an unreadable report that is gone (rotated out) is no longer a problem
        for path in paths:
            # A folded report is remembered by its id (SidecarState.apply_report), a skipped file by its name:
            # checking the name alone read every report again each round (and would log it again).
            if path.stem in state.reports_seen or path.name in state.reports_seen:
                continue
            try:
                report = read_report(path)
            except FileNotFoundError:
                continue
            except OSError as exc:
                state.reports_seen.add(path.name)
                self._skip("report", "unreadable", path, exc)
                continue
            except ValueError as exc:
                state.reports_seen.add(path.name)
                self._skip("report", "corrupt", path, exc)
                continue
            state.apply_report(report)
            self.failure_lines.take(report)
            folded += 1
        return folded

    def checkpoint(self) -> None:
        """Save the state; a checkpoint it cannot write (another uid's file or directory) is reported as
        unreadable, not raised: it is the environment's fault, and every round would count it again."""
        with self.lock:
            data = json.dumps(self.state.to_json(), allow_nan=False).encode()
        self._last_checkpoint = time.monotonic()
        try:
            write_durably(self.checkpoint_path, data)
        except OSError as exc:
            with self.lock:
                if str(self.checkpoint_path) not in self.unreadable:
                    logger.error("kvobs sidecar: cannot write checkpoint %s: %s", self.checkpoint_path, exc)
                self._unreadable(self.checkpoint_path, f"cannot write: {exc.strerror or exc}")
            return
        with self.lock:
            if self.unreadable.get(str(self.checkpoint_path), "").startswith("cannot write"):
                del self.unreadable[str(self.checkpoint_path)]

    def run(self) -> None:
        """Poll until ``stop()``; a failing round is counted and logged, never fatal."""
        while not self._stop.is_set():
            try:
                self.poll()
            except Exception as exc:
                self.errors += 1
                if self.errors == 1:
                    logger.exception("kvobs sidecar ingest round failed: %r", exc)
            self._stop.wait(POLL_S)
        self.checkpoint()

    def stop(self) -> None:
        self._stop.set()
