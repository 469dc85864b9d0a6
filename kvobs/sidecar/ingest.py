"""Follow every engine's journal files and failure reports in a kvobs directory.

Picks up engines that start later (new files), keeps what it has when they die, follows each
journal file by its identity (st_dev, st_ino) through a rename in the same directory (logrotate's
``create``: the engine goes on writing the renamed file) and a cut back (``copytruncate``), forgets
the position of files gone, and checkpoints its state (with every file position) atomically, so a
restart neither loses nor double counts (docs/reliability.md, "Rotated journals"). One file it cannot read (another
uid's, a symlink, a damaged report) is skipped, counted by source and reason, and named
once in the log; the others are read as usual. Each report read is logged once as a structured
line (``kvobs.sidecar.log_format.FailureLines``), and a round that read one checkpoints at once, so a
restarted sidecar does not log it again.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from pathlib import Path
from typing import NamedTuple

from kvobs.files import private_dir, write_durably
from kvobs.sidecar.log_format import FailureLines
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
MAX_ROTATED = 1_000
"""Rotated journal files (:data:`ROTATED`) followed at most; beyond it the longest unchanged are forgotten."""
ROTATED = re.compile(r"(?P<journal>.+" + re.escape(JOURNAL_SUFFIX) + r")[.-][0-9][0-9._-]{0,31}")
"""A journal renamed or copied by logrotate in the same directory: ``<journal>.1``, ``<journal>-20261206``
(``dateext``). Compressed ones (``.gz``) are not read."""


class JournalFile(NamedTuple):
    """A journal file as listed: where it is, whose it is, and which file it is."""

    path: Path
    segment: str
    """The journal file name it is (a rotated one: the name it had): every file of a segment holds one
    stream of lines, so they share its removal serials (kvobs.wire.decode.JournalPosition.serials)."""
    stem: str
    key: str
    """Its position's key in the state and checkpoint (:func:`file_key`)."""
    identity: tuple[int, int]
    rotated: bool
    mtime: float
    size: int


def file_key(stem: str, st: os.stat_result) -> str:
    """A journal file's identity as its position is kept: ``<st_dev>:<st_ino>:<stem>``. Not its name, which
    rotation changes; the stem too, so an inode reused by another engine's new file is a new file."""
    return f"{st.st_dev}:{st.st_ino}:{stem}"


def list_journals(journal_dir: Path) -> list[JournalFile]:
    """The journal files (``*.jsonl``) and rotated journal files (:data:`ROTATED`) in ``journal_dir``, by name;
    OSError if it cannot be listed (a missing directory lists as empty)."""
    found: list[JournalFile] = []
    try:
        entries = list(os.scandir(journal_dir))
    except FileNotFoundError:
        return []
    for entry in entries:
        rotated = ROTATED.fullmatch(entry.name)
        if rotated is None and not entry.name.endswith(JOURNAL_SUFFIX):
            continue
        try:
            st = entry.stat(follow_symlinks=False)  # a symlink is listed, and skipped as unreadable when read
        except FileNotFoundError:
            continue
        segment = rotated.group("journal") if rotated else entry.name
        stem = stem_of(segment)
        found.append(JournalFile(Path(entry.path), segment, stem, file_key(stem, st), (st.st_dev, st.st_ino),
                                 rotated is not None, st.st_mtime, st.st_size))
    # A segment's rotated files first, oldest first, then the file at its name: a copy's lines (those
    # written before the copy) come before the cut-back original's, so serials rise in reading order.
    return sorted(found, key=lambda f: (f.segment, not f.rotated, f.mtime, f.path.name))


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
            found = list_journals(journal_dir) if journal_dir.is_dir() else []
            with self.lock:
                self.unreadable.pop(str(journal_dir), None)
        except OSError as exc:
            found = []
            with self.lock:
                self._skip("journal", "unreadable", journal_dir, exc)
        with self.lock:
            files = self._followed(found)
            self.state.retire_writers({f.stem for f in files})
        unfinished: set[str] = set()
        for file in files:
            if self._stop.is_set():  # stopping: the exit checkpoint must not wait for a long round (serve's join)
                break
            if file.segment in unfinished:  # its later files' serials would pass over the lines left
                continue
            with self.lock:
                offset, skipping, _ = self.state.positions[file.key]
                serials: dict[str, int] = {}
                for other in files:  # a segment's files share its serials: a line is folded once, from any
                    if other.segment == file.segment:
                        for run, serial in self.state.positions[other.key][2].items():
                            serials[run] = max(serial, serials.get(run, 0))
            if not self._read_journal(file, offset, skipping, serials):
                unfinished.add(file.segment)
        with self.lock:
            new_reports = self._read_reports()
            self.last_poll = time.time()
        self.failure_lines.write()  # outside the lock: a slow log pipe never holds up a scrape
        # A report's line is logged once: its name is in the checkpoint as soon as the line is out.
        if new_reports or time.monotonic() - self._last_checkpoint >= CHECKPOINT_EVERY_S:
            self.checkpoint()

    def _followed(self, found: list[JournalFile]) -> list[JournalFile]:
        """The files to read (under the lock), each with a position by identity; the positions of files gone
        are dropped.

        A file renamed (logrotate's ``create``: the engine writes on into it through its open descriptor)
        keeps its position; a new file at its old name is a new identity, read from its start; so is a
        ``copytruncate`` copy, whose removal lines already read are known by their serials (shared by the
        segment's files) and skipped: only what the original lost to the cut is read from it. Rotated
        files beyond the ``MAX_ROTATED`` most recently changed are forgotten."""
        positions = self.state.positions
        legacy = any(key.endswith(JOURNAL_SUFFIX) for key in positions)  # a checkpoint keyed by name (issue 40)
        for f in found:
            if f.key not in positions:
                old = positions.pop(f.path.name, None)
                if old is not None and not f.rotated:
                    positions[f.key] = (old[0], old[1], {})
                else:  # a rotated file at the upgrade: its lines were read from the original (no serials yet)
                    positions[f.key] = (f.size, False, {}) if legacy and f.rotated else (0, False, {})
        files = list(found)
        rotated = sorted((f for f in files if f.rotated), key=lambda f: f.mtime, reverse=True)
        forgotten = {f.key for f in rotated[MAX_ROTATED:]}
        files = [f for f in files if f.key not in forgotten]
        present = {f.key for f in files}
        for key in [k for k in positions if k not in present]:
            del positions[key]  # removed (or a rotated file beyond MAX_ROTATED)
        return files

    def _read_journal(self, file: JournalFile, offset: int, skipping: bool, serials: dict[str, int]) -> bool:
        """Read what is new in ``file`` (at most ``ROUND_BYTES``), folding it; False if it has more to read."""
        path, stem, key = file.path, file.stem, file.key
        given_up = offset < 0  # unreadable last time: tried again quietly, read from the start if it now is
        if given_up:
            offset, skipping = 0, False
        budget = ROUND_BYTES
        position = JournalPosition(offset, skipping, serials=dict(serials), identity=file.identity)
        while budget > 0:
            position.rewound = False
            try:
                records = list(read_new_records(path, position, min(SLICE_BYTES, budget)))
                if position.offset == offset and budget > SLICE_BYTES:  # a line longer than a slice
                    records = list(read_new_records(path, position, budget))
            except FileNotFoundError:  # removed, or renamed since listed: read under its new name next round
                with self.lock:
                    self.unreadable.pop(str(path), None)
                return False
            except OSError as exc:  # another uid's file, a symlink, a FIFO: skipped, the others go on
                if not given_up:
                    with self.lock:
                        self.state.positions[key] = (-1, False, serials)  # -1: unreadable, counted once
                        self._skip("journal", "unreadable", path, exc)
                return True
            if given_up:
                with self.lock:
                    self.unreadable.pop(str(path), None)
                given_up = False
            if position.rewound:  # copy-truncate rotation or a truncate: its later lines are read (issue 31)
                logger.warning("kvobs sidecar: journal %s was cut back under the reader (copy-truncate "
                               "rotation or a truncate); reading it again from its start", path)
                budget -= position.offset
            elif position.offset == offset and position.skipping == skipping:
                return True
            else:
                budget -= position.offset - offset
            offset, skipping = position.offset, position.skipping
            with self.lock:
                for record in records:
                    if record is None:
                        self._skip("journal", "corrupt", path, "a line that is not a kvobs record")
                    else:
                        self.state.apply(record, stem)
                self.state.positions[key] = (offset, skipping, dict(position.serials))
            time.sleep(0)  # hand the GIL to a waiting scrape between slices
        return False

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
