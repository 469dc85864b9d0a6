"""Issue 31, classes 3, 4 and 5, as an operator meets them, each with real processes.

3. Two engines with the same label (two models on one node, both engine "0") in one ``KVOBS_DIR``:
   the second's start must not delete the first's live journal.
4. A journal that shrinks under a running ``kvobs serve`` (copy-truncate rotation, an operator's
   ``truncate``): the sidecar must read the engine's later lines, final totals included.
5. SIGHUP to ``kvobs serve`` (a closed terminal, ssh or tmux session): it must checkpoint on the way
   out, so that restarted it never serves a counter lower than before.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvobs.journal import JournalFiles
from kvobs.options import Options
from kvobs.sidecar.ingest import CHECKPOINT, CHECKPOINT_EVERY_S, Ingest, file_key
from kvobs.wire.decode import JournalPosition, read_new_records
from kvobs.wire.format import stem_of
from tests.support.faults import tmpfs
from tests.support.services import ROOT, Sidecar, clean_env, wait_for
from tests.support.sidecar_input import scrape, write_engine

pytestmark = pytest.mark.slow


class LiveEngine:
    """tests/support/live_engine.py as a process: a real observed vLLM manager that stores when told."""

    def __init__(self, directory: Path, **options: Any) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.support.live_engine", str(directory), json.dumps(options)],
            cwd=ROOT, env=clean_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.expect("ready")

    def expect(self, word: str) -> None:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().strip()
        assert line == word, f"the engine said {line!r}, not {word!r}"

    def say(self, command: str, answer: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        self.expect(answer)

    def exit(self) -> None:
        self.say("exit", "done")
        assert self.proc.wait(timeout=30) == 0

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def stored(url: str, model: str, engine: str = "0") -> float:
    """``kvobs_stored_chunks_total`` of one engine (all tiers) on the sidecar's /metrics."""
    return sum(value for (name, labels), value in scrape(url).items()
               if name == "kvobs_stored_chunks_total" and ("model_name", model) in labels
               and ("engine", engine) in labels)


@pytest.mark.parametrize("kept", [0, 1])
def test_a_second_engine_with_the_same_label_keeps_the_first_ones_live_journal(tmp_path: Path, kept: int) -> None:
    """Two models on one node, both engine "0", one directory. The second engine's start prunes its
    label's earlier processes' journals; the first engine is alive, so its journal must stay, and
    everything it does afterwards must reach the sidecar. Before the fix, with ``journal_processes``
    0 (or ``kept`` dead processes of that label besides) the first engine's live segment was deleted:
    its later stores and its final totals were never read."""
    sidecar = Sidecar(tmp_path).start()
    engines: list[LiveEngine] = []
    try:
        for _ in range(kept):  # earlier processes of label "0", dead now (a crash loop's leftovers)
            dead = LiveEngine(tmp_path, engine="0", model_name="model-old", journal_processes=kept)
            dead.say("store 1", "stored")
            dead.exit()
        first = LiveEngine(tmp_path, engine="0", model_name="model-a", journal_processes=kept)
        engines.append(first)
        first.say("store 3", "stored")
        wait_for(lambda: stored(sidecar.url, "model-a") == 3, what="the first engine's stores on /metrics")
        second = LiveEngine(tmp_path, engine="0", model_name="model-b", journal_processes=kept)
        engines.append(second)
        first.say("store 4", "stored")
        second.say("store 2", "stored")
        first.exit()
        second.exit()
        wait_for(lambda: stored(sidecar.url, "model-a") == 7 and stored(sidecar.url, "model-b") == 2,
                 timeout=10, what="both engines' stores on /metrics")
        journals = sorted(p.name for p in (tmp_path / "journal").iterdir())
        assert len(journals) == 2 + kept, journals  # the two engines' and the newest `kept` dead ones
    finally:
        for engine in engines:
            engine.kill()
        sidecar.stop()


def corrupt_lines(url: str) -> float:
    return scrape(url).get(("kvobs_sidecar_skipped_total", frozenset({("source", "journal"), ("reason", "corrupt")})),
                           0.0)


def copy_truncate(segment: Path) -> None:
    """What logrotate's ``copytruncate`` does: copy the file aside, then truncate it in place (the
    writer keeps its descriptor and appends at the new end)."""
    rotated = segment.with_name(segment.name + ".1")
    rotated.write_bytes(segment.read_bytes())
    with segment.open("r+b") as f:
        f.truncate(0)


@pytest.mark.parametrize("cut", ["copytruncate", "truncate"])
def test_a_journal_cut_back_under_a_running_sidecar_is_read_on(tmp_path: Path, cut: str) -> None:
    """A running ``kvobs serve`` has read an engine's journal some way; the segment is rotated by
    copy-truncate (or an operator truncates it); the engine stores more and exits. Before the fix the
    sidecar kept its old offset, past the file's new end: the later stores and the final totals were
    never read (stuck at 3)."""
    sidecar = Sidecar(tmp_path).start()
    engine = LiveEngine(tmp_path, engine="0", model_name="model-a")
    try:
        engine.say("store 3", "stored")
        wait_for(lambda: stored(sidecar.url, "model-a") == 3, what="the engine's stores on /metrics")
        time.sleep(2)  # the engine writes its totals every 0.25 s: the offset grows past what follows the cut
        (segment,) = (tmp_path / "journal").iterdir()
        if cut == "copytruncate":
            copy_truncate(segment)
        else:
            with segment.open("r+b") as f:
                f.truncate(0)
        engine.say("store 4", "stored")
        engine.exit()
        wait_for(lambda: stored(sidecar.url, "model-a") == 7, timeout=10, what="the later stores on /metrics")
        assert corrupt_lines(sidecar.url) == 0
        assert any("was cut back under the reader" in line for line in sidecar.log_lines())
    finally:
        engine.kill()
        sidecar.stop()


def test_a_restarted_sidecar_reads_a_journal_rotated_while_it_was_down(tmp_path: Path) -> None:
    """The sidecar stops (its checkpoint holds its offset), the journal is copy-truncated and the
    engine writes on past that offset before the sidecar starts again. Before the fix it read from its
    old offset, the middle of a line: a corrupt line counted, and the lines before it lost."""
    sidecar = Sidecar(tmp_path).start()
    engine = LiveEngine(tmp_path, engine="0", model_name="model-a")
    try:
        engine.say("store 3", "stored")
        wait_for(lambda: stored(sidecar.url, "model-a") == 3, what="the engine's stores on /metrics")
        sidecar.stop()
        (segment,) = (tmp_path / "journal").iterdir()
        key = file_key(stem_of(segment.name), segment.stat())
        offset = json.loads((tmp_path / "sidecar-state.json").read_text())["positions"][key][0]
        copy_truncate(segment)
        engine.say("store 4", "stored")
        wait_for(lambda: segment.stat().st_size > offset + 1, timeout=30, what="the engine writing past the offset")
        engine.exit()
        sidecar = Sidecar(tmp_path).start()
        wait_for(lambda: stored(sidecar.url, "model-a") == 7, timeout=10, what="the later stores on /metrics")
        assert corrupt_lines(sidecar.url) == 0
    finally:
        engine.kill()
        sidecar.stop()


def test_kvobs_cuts_a_failed_append_back_to_its_last_whole_line(tmp_path: Path) -> None:
    """kvobs's own cut-back after a short write on a full disk: it used to cut the whole append off,
    whole lines a reader may already have read included, so the file shrank under that reader's
    position. Now only the partial line goes; the reader's position stays inside the file."""

    with tmpfs(tmp_path / "mnt", size="64k") as mount:
        files = JournalFiles(mount / "kvobs", "0", Options())
        files.write(b"first\n")
        filler = mount / "filler"
        fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
        try:  # fill the file system, then free a little less than the append below needs
            for size in (4096, 512, 1):
                with contextlib.suppress(OSError):
                    while os.write(fd, b"\0" * size):
                        pass
            os.ftruncate(fd, os.fstat(fd).st_size - 3000)
        finally:
            os.close(fd)
        lines = [f"line {i:04d} {'x' * 90}\n".encode() for i in range(64)]  # 6,400 bytes
        with pytest.raises(OSError):
            files.write(b"".join(lines))
        (segment,) = (mount / "kvobs" / "journal").iterdir()
        data = segment.read_bytes()
        assert data.endswith(b"\n") and data.startswith(b"first\n")
        assert files.lines_kept > 0 and data == b"first\n" + b"".join(lines[: files.lines_kept])
        position = JournalPosition(len(data))
        filler.unlink()
        files.write(b"after\n")
        files.close()
        list(read_new_records(segment, position))
        assert not position.rewound and position.offset == len(data) + len(b"after\n")


@pytest.mark.parametrize("signums", [[signal.SIGHUP], [signal.SIGTERM], [signal.SIGINT],
                                     [signal.SIGHUP, signal.SIGTERM]],
                         ids=["SIGHUP", "SIGTERM", "SIGINT", "SIGHUP-then-SIGTERM"])
def test_a_hung_up_sidecar_checkpoints_and_restarted_never_serves_a_lower_counter(tmp_path: Path,
                                                                                  signums: list[int]) -> None:
    """``kvobs serve`` in a terminal, ssh or tmux session that closes gets SIGHUP. Before the fix it died
    without its exit checkpoint: restarted, it served the counters of its last periodic checkpoint (up
    to 5 s old), lower than before, which Prometheus reads as a counter reset. The engine here writes
    its journal, then the sidecar reads it, then the engine goes on and exits; a checkpoint taken only
    on the way out holds the later counts, and the restarted sidecar serves them from its first scrape
    on, whatever it reads (the engine's files are gone: only the checkpoint can know)."""
    # As from a terminal, where Ctrl-C reaches it: a test run in the background of a shell without job
    # control (nohup, cron) ignores SIGINT, and a child inherits an ignored signal through exec.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        sidecar = Sidecar(tmp_path).start()
    finally:
        signal.signal(signal.SIGINT, previous)
    engine = LiveEngine(tmp_path, engine="0", model_name="model-a")
    try:
        engine.say("store 3", "stored")
        wait_for(lambda: stored(sidecar.url, "model-a") == 3, what="the first stores on /metrics")
        checkpoint = tmp_path / CHECKPOINT
        before = wait_for(lambda: checkpoint.exists() and checkpoint.stat().st_mtime_ns, what="a checkpoint")
        wait_for(lambda: checkpoint.stat().st_mtime_ns != before, timeout=CHECKPOINT_EVERY_S + 5,
                 what="the next periodic checkpoint")  # with 3: the next is CHECKPOINT_EVERY_S away
        engine.say("store 4", "stored")
        wait_for(lambda: stored(sidecar.url, "model-a") == 7, what="the later stores on /metrics")
        engine.exit()
        served = stored(sidecar.url, "model-a")
        assert sidecar.proc is not None
        for signum in signums:  # a second one (the supervisor's SIGTERM after the hang-up) must not cut it short
            sidecar.proc.send_signal(signum)
        status = sidecar.proc.wait(timeout=15)
        shutil.rmtree(tmp_path / "journal")  # the engine's files rotated away meanwhile: the checkpoint alone knows
        restarted = Sidecar(tmp_path).start()
        try:
            assert stored(restarted.url, "model-a") >= served == 7
        finally:
            restarted.stop()
        assert status == 0, sidecar.log_lines()
    finally:
        engine.kill()
        sidecar.stop()


def test_an_engine_running_unobserved_keeps_its_line_when_another_with_its_label_starts(tmp_path: Path) -> None:
    """An engine kvobs stepped aside from writes one line saying so (``kvobs_observing 0``). Another engine
    with the same label starting in the same directory must not prune it while that engine lives."""

    script = ("import sys; from kvobs.journal import announce_unobserved; from kvobs.options import Options; "
              f"announce_unobserved(Options(dir={str(tmp_path)!r}, engine='0'), 'test', 'error', 'why'); "
              "print('ready', flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, env=clean_env(), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        (announced,) = (tmp_path / "journal").iterdir()
        JournalFiles(tmp_path, "0", Options(journal_processes=0)).close()
        assert announced.exists()
    finally:
        child.communicate(timeout=30)
    JournalFiles(tmp_path, "0", Options(journal_processes=0)).close()  # dead now: pruned as an earlier process
    assert not announced.exists()


def test_a_stopping_sidecar_reads_no_further_file_before_its_exit_checkpoint(tmp_path: Path) -> None:
    """``kvobs serve`` waits 10 s for its ingest thread's exit checkpoint; a round over a long backlog
    could outlast that, and the process ended without it. Once stopping, a round reads no further file."""
    for engine in ("0", "1"):
        write_engine(tmp_path, engine, removals=3)
    ingest = Ingest(tmp_path)
    ingest.stop()
    ingest.poll()
    assert all(offset == 0 for offset, _, _ in ingest.state.positions.values()) and ingest.state.engines == {}
    ingest.checkpoint()
    restarted = Ingest(tmp_path)
    restarted.poll()  # what the stopped one left unread is read after the restart
    assert {identity[1] for identity in restarted.state.engines} == {"0", "1"}
