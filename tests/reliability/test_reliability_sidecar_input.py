"""What is on disk cannot stop or corrupt the sidecar: each bad file or record is skipped, counted
once (source and reason), named once in the log, and everything else is read as usual.

Journals and reports here are written by kvobs's own JournalSink around an Observer (no vLLM
needed for the engine side); the sidecar is ``kvobs serve`` in its own process where that matters
(start-up, another uid), else its Ingest in this process.
"""

from __future__ import annotations

import json
import os
import pwd
import shutil
import time
from pathlib import Path
from typing import Any

import pytest

from kvobs.journal import JournalSink
from kvobs.observer import Observer
from kvobs.options import Options
from kvobs.sidecar.ingest import CHECKPOINT, Ingest
from kvobs.sidecar.metrics import KvobsCollector
from kvobs.wire.format import MAX_LINE_BYTES
from tests.support.removals import record_removal
from tests.support.services import http_get, wait_for
from tests.support.sidecar_input import scrape, serve, skipped, write_engine


def metrics(ingest: Ingest) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in KvobsCollector(ingest).collect() for s in family.samples}


def evicted(values: dict[Any, float], engine: str) -> float:
    return values[("kvobs_evicted_chunks_total", frozenset({("model_name", ""), ("engine", engine),
                                                             ("reason", "capacity")}))]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and util-linux setpriv to make files the sidecar may not open")
def test_files_the_sidecar_may_not_open_are_skipped_at_start_and_after(tmp_path: Path) -> None:
    """Another uid's files with mode 0600: the sidecar skips them, counts them, names each once in
    its log, serves, stays healthy, and reads every other file."""
    directory = tmp_path / "kvobs"
    write_engine(directory, "e0", 5, fail=True)
    write_engine(directory, "e1", 7, fail=True)
    [journal] = (directory / "journal").glob("e1-*.jsonl")
    [report] = [p for p in (directory / "failures").glob("*.json") if "-e1-" in p.name]
    nobody = pwd.getpwnam("nobody").pw_uid
    for path in (journal, report):
        os.chown(path, nobody, -1)
        os.chmod(path, 0o600)
    proc, url = serve(directory, without_file_override=True)
    try:
        wait_for(lambda: http_get(f"{url}/healthz")[0] == 200, what="the sidecar despite unreadable files")
        time.sleep(1.5)  # a few more ingest rounds: each file still counted once
        values = scrape(url)
        assert skipped(values, "journal", "unreadable") == 1 and skipped(values, "report", "unreadable") == 1
        assert evicted(values, "e0") == 5  # the readable engine is read whole
        failures = json.loads(http_get(f"{url}/api/v1/failures")[2])["failures"]
        assert [f["engine"] for f in failures] == ["e0"]
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=15)
    lines = err.splitlines()
    assert sum(journal.name in line for line in lines) == 1 and sum(report.name in line for line in lines) == 1, err


def test_a_fifo_and_symlinks_are_not_journals_or_reports(tmp_path: Path) -> None:
    directory = tmp_path / "kvobs"
    write_engine(directory, "e0", 3, fail=True)
    secret = tmp_path / "secret.json"
    secret.write_text(json.dumps({"kind": "failure", "engine": "x", "time": 1.0, "cause": "unknown",
                                  "missing": []}))
    (directory / "failures" / "999999999999999-x-1-0.json").symlink_to(secret)
    (directory / "journal" / "e9-1.000000.jsonl").symlink_to(tmp_path / "elsewhere.jsonl")
    os.mkfifo(directory / "journal" / "e8-1.000000.jsonl")  # nobody writes it: opening must not block
    ingest = Ingest(directory)
    ingest.poll()
    values = metrics(ingest)
    assert evicted(values, "e0") == 3 and skipped(values, "report", "unreadable") == 1
    assert skipped(values, "journal", "unreadable") == 2
    from kvobs.sidecar.failures import FailureQuery, failure_page

    served, _ = failure_page(directory / "failures", FailureQuery(limit=10))
    assert [f["engine"] for f in served] == ["e0"]  # the link is not served


def test_numbers_no_float_can_hold_are_skipped_not_saved_and_not_served(tmp_path: Path) -> None:
    directory = tmp_path / "kvobs"
    write_engine(directory, "e0", 4)
    [journal] = (directory / "journal").glob("e0-*.jsonl")
    with open(journal, "a") as f:
        f.write('{"k":"totals","e":"e0","pid":1,"run":"x","t":1.0,"evicted":{"capacity":1e400}}\n')
        f.write('{"k":"totals","e":"e0","pid":1,"run":"y","t":1.0,"evicted":{"capacity":NaN}}\n')
        f.write('{"k":"totals","e":"e0","pid":1,"run":"z","t":1e400}\n')
    (directory / "failures" / "000000000000001-e0-1-0.json").write_text(
        '{"kind":"failure","engine":"e0","time":1.0,"cause":"unknown","missing":[{"group":0,'
        '"cause":"unknown","seconds_since_eviction":1e999}]}')
    ingest = Ingest(directory)
    ingest.poll()
    values = metrics(ingest)
    assert evicted(values, "e0") == 4
    assert skipped(values, "journal", "corrupt") == 3 and skipped(values, "report", "corrupt") == 1
    ingest.checkpoint()
    saved = (directory / CHECKPOINT).read_text()
    assert "Infinity" not in saved and "NaN" not in saved
    restarted = Ingest(directory)  # the checkpoint reads back, trusted
    assert evicted(metrics(restarted), "e0") == 4
    checkpoint = json.loads(saved)
    next(e for e in checkpoint["engines"] if e["engine"] == "e0")["retired"] = {"evicted": {"capacity": 1e300}}
    (directory / CHECKPOINT).write_text(json.dumps(checkpoint))
    distrusted = Ingest(directory)  # a checkpoint with a number it cannot hold is not restored
    distrusted.poll()
    values = metrics(distrusted)
    assert evicted(values, "e0") == 4 and skipped(values, "checkpoint", "corrupt") == 1


def test_a_failure_report_with_out_of_range_numbers_does_not_stop_the_sidecar(tmp_path: Path) -> None:
    directory = tmp_path / "kvobs"
    write_engine(directory, "e0", 2, fail=True)
    (directory / "failures" / "000000000000001-e0-1-0.json").write_text(
        '{"kind":"failure","engine":"e0","time":1e400,"cause":"unknown","missing":[]}')
    proc, url = serve(directory)
    try:
        wait_for(lambda: http_get(f"{url}/healthz")[0] == 200, what="the sidecar despite a damaged report")
        assert skipped(scrape(url), "report", "corrupt") == 1
        assert len(json.loads(http_get(f"{url}/api/v1/failures")[2])["failures"]) == 1
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def test_totals_stay_exact_whatever_the_number_of_writers_of_one_engine(tmp_path: Path) -> None:
    """Twenty live writers of one engine label (a shared KVOBS_DIR, repeated observe() calls): every
    writer's cumulative totals are counted once, however the sidecar's polls interleave with them."""
    directory = tmp_path / "kvobs"
    ingest = Ingest(directory)
    writers = []
    for _ in range(20):
        observer = Observer(Options(engine="shared"))
        sink = JournalSink(directory, observer.options, "test")
        observer.add_sink(sink)
        writers.append((observer, sink))
    for round_ in range(30):
        for n, (observer, sink) in enumerate(writers):
            record_removal(observer, [(round_ * 100 + n).to_bytes(32, "big") + b"\0\0\0\0"], "capacity", "store", "r")
            if (round_ + n) % 7 == 0:
                sink.flush()
        ingest.poll()
    for _, sink in writers:
        sink.close()
    ingest.poll()
    assert evicted(metrics(ingest), "shared") == 20 * 30


def test_an_over_long_line_is_one_skipped_record(tmp_path: Path) -> None:
    directory = tmp_path / "kvobs"
    write_engine(directory, "e0", 2)
    [journal] = (directory / "journal").glob("e0-*.jsonl")
    with open(journal, "ab") as f:
        f.write(b"x" * (MAX_LINE_BYTES * 2 + 123) + b"\n")
        f.write(b'{"k":"hello","e":"e7","pid":1,"run":"r","t":1.0}\n')
    ingest = Ingest(directory)
    for _ in range(6):
        ingest.poll()
    values = metrics(ingest)
    assert skipped(values, "journal", "corrupt") == 1
    assert ("kvobs_build_info", frozenset({("model_name", ""), ("engine", "e7"), ("version", ""), ("vllm_version", ""),
                                           ("hot_path", "")})) in values  # the line after it is read
