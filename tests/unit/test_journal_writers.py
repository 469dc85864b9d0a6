"""Two observed managers with one engine name in one process (`kvobs.observe()` twice, both with the
default `engine="0"`) each keep their own journal segments: neither rotates the other's away."""

from __future__ import annotations

import os
from pathlib import Path

from kvobs import journal
from kvobs.journal import JournalSink
from kvobs.observer import Observer
from kvobs.options import Options
from kvobs.sidecar.ingest import Ingest
from tests.support.removals import record_removal


def test_two_writers_of_one_engine_in_one_process_keep_their_own_segments(tmp_path: Path) -> None:
    directory = tmp_path / "kvobs"
    ingest = Ingest(directory)
    writers = []
    for _ in range(2):
        observer = Observer(Options(dir=str(directory), engine="e0", journal_bytes=4 * 4096))  # roll often
        sink = JournalSink(directory, observer.options)
        observer.add_sink(sink)
        writers.append((observer, sink))
    for i in range(600):
        for k, (observer, _) in enumerate(writers):
            record_removal(observer, [bytes(32) + (2 * i + k).to_bytes(4, "big")], "capacity", "store", f"r{k}")
        if i % 50 == 49:
            for _, sink in writers:
                sink.flush()
            ingest.poll()
    for _, sink in writers:
        sink.close()
    ingest.poll()
    assert ingest.state.engines[("", "e0")].totals()["evicted"]["capacity"] == 1200
    stems = {p.name.rsplit(".", 2)[0] for p in (directory / "journal").glob("*.jsonl")}
    assert stems == {f"e0-{os.getpid()}", f"e0-{os.getpid()}_1"}
    assert len(list((directory / "journal").glob("*.jsonl"))) <= 2 * journal.KEEP_SEGMENTS


def test_a_closed_writers_name_is_free_again(tmp_path: Path) -> None:
    first = JournalSink(tmp_path, Options(engine="e1"))
    first.close()
    second = JournalSink(tmp_path, Options(engine="e1"))
    second.close()
    assert {p.name.rsplit(".", 2)[0] for p in (tmp_path / "journal").glob("*.jsonl")} == {f"e1-{os.getpid()}"}
