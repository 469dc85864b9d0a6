"""Follow every engine's journal files and failure reports in a kvobs directory.

Picks up engines that start later (new files), keeps what it has when they die,
forgets the position of rotated-away files, and checkpoints its state (with
every file offset) atomically, so a restart neither loses nor double counts.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

from kvobs.journal import JournalPosition, private_dir, read_new_records, read_report, write_durably
from kvobs.sidecar.state import SidecarState, load_checkpoint

logger = logging.getLogger("kvobs.sidecar")

CHECKPOINT = "sidecar-state.json"
POLL_S = 0.5
ROUND_BYTES = 8 * 2**20  # per journal file and round
SLICE_BYTES = 2**20  # folded under the lock at once
CHECKPOINT_EVERY_S = 5.0


class Ingest:
    """Folds new records into ``state`` under ``lock``; call ``poll()`` or ``run()``."""

    def __init__(self, directory: Path) -> None:
        self.dir = private_dir(directory)
        self.checkpoint_path = self.dir / CHECKPOINT
        self.lock = threading.Lock()
        self.errors = 0
        try:
            restored = load_checkpoint(self.checkpoint_path)
        except (ValueError, KeyError, TypeError) as exc:
            logger.error("kvobs sidecar: ignoring unreadable checkpoint %s: %r", self.checkpoint_path, exc)
            restored, self.errors = None, 1
        self.state = restored or SidecarState()
        self.last_poll = 0.0
        self._last_checkpoint = time.monotonic()
        self._stop = threading.Event()

    def poll(self) -> None:
        """Read whatever is new; checkpoint when due.

        Lines are read and parsed outside the lock and folded under it in slices
        of at most ``SLICE_BYTES`` (each slice with its file offset, so a checkpoint
        never sees records without their offset): a scrape waits for one slice,
        not for a whole round of every engine's journal.
        """
        journal_dir = self.dir / "journal"
        files = sorted(journal_dir.glob("*.jsonl")) if journal_dir.is_dir() else []
        with self.lock:
            state = self.state
            present = {f.name for f in files}
            for name in [n for n in state.positions if n not in present]:
                del state.positions[name]  # rotated away or removed
            offsets = {f.name: state.positions.get(f.name, 0) for f in files}
        for path in files:
            offset, budget = offsets[path.name], ROUND_BYTES
            while budget > 0:
                position = JournalPosition(offset)
                try:
                    records = list(read_new_records(path, position, min(SLICE_BYTES, budget)))
                    if position.offset == offset and budget > SLICE_BYTES:  # a line longer than a slice
                        records = list(read_new_records(path, position, budget))
                except FileNotFoundError:
                    break
                if position.offset == offset:
                    break
                budget -= position.offset - offset
                offset = position.offset
                with self.lock:
                    for record in records:
                        state.apply(record)
                    state.positions[path.name] = offset
                time.sleep(0)  # hand the GIL to a waiting scrape between slices
        with self.lock:
            self._read_reports()
            self.last_poll = time.time()
        if time.monotonic() - self._last_checkpoint >= CHECKPOINT_EVERY_S:
            self.checkpoint()

    def _read_reports(self) -> None:
        failures = self.dir / "failures"
        if not failures.is_dir():
            return
        for path in sorted(failures.glob("*.json")):
            if path.name in self.state.reports_seen:
                continue
            try:
                report = read_report(path)
            except FileNotFoundError:
                continue
            except ValueError:
                self.state.reports_seen.add(path.name)
                self.state.corrupt += 1
                continue
            self.state.apply_report(path.name, report)

    def checkpoint(self) -> None:
        with self.lock:
            data = json.dumps(self.state.to_json()).encode()
        write_durably(self.checkpoint_path, data)
        self._last_checkpoint = time.monotonic()

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
