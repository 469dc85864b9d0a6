"""Unusual but legal input against the real ``kvobs serve`` (issue 21): long names, a journal
backlog, API parameters, numbers no float holds.

Journals and reports are written by kvobs's own JournalSink around an Observer (the engine side
needs no vLLM for these); the sidecar is ``kvobs serve`` in its own process.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvobs.diagnosis import MISSING
from kvobs.journal import JournalSink
from kvobs.observer import Observer, Unloadable
from kvobs.options import Options
from kvobs.wire.format import MAX_LINE_BYTES
from tests.support.removals import record_removal
from tests.support.services import ROOT, http_get
from tests.support.sidecar_input import scrape, serve, skipped


def _key(i: int) -> bytes:
    return i.to_bytes(32, "big") + b"\0\0\0\0"


def _fail(observer: Observer, sink: JournalSink, req_id: str = "req-f") -> None:
    diagnosis = observer.load_failed("Chunk b'x' not found in cache", req_id, 1, None,
                                     [Unloadable(b"\1" * 36, 0, None, MISSING)], 0)
    observer.publish_failure(diagnosis, AssertionError(diagnosis.message))  # the counters, then the sinks


def _engine(directory: Path, **options: Any) -> tuple[Observer, JournalSink]:
    observer = Observer(Options(**options))
    sink = JournalSink(directory, observer.options, "test")
    observer.add_sink(sink)
    return observer, sink


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[Any]:
    """Starts ``kvobs serve`` on a directory once it is written; fails fast if the process exits."""
    procs: list[subprocess.Popen[str]] = []

    def start(directory: Path) -> str:
        proc, url = serve(directory)
        procs.append(proc)

        deadline = time.monotonic() + 30
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if http_get(f"{url}/healthz")[0] == 200:
                    return url
            except OSError:
                pass  # not listening yet
            time.sleep(0.2)
        raise AssertionError(f"kvobs serve is not up (exit status {proc.poll()})")

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
        proc.communicate(timeout=15)


def _series(values: dict[Any, float], name: str, **labels: str) -> list[float]:
    return [v for (n, ls), v in values.items() if n == name and set(labels.items()) <= ls]


# -- class 1: one limit for writer and reader; the writer fits what is too long ---------------------------


@pytest.mark.parametrize("model_name", [
    "/mnt/models/" + "a" * 288,  # a legal 300-character --model path (the report of issue 21)
    "/mnt/models/" + "b" * 5000,  # longer than any label the sidecar takes: fitted, not dropped
    "/mnt/models/new\nline",  # not printable: fitted
], ids=["300 chars", "5012 chars", "newline"])
def test_a_long_or_odd_model_path_does_not_hide_the_engine(tmp_path: Path, sidecar: Any, model_name: str) -> None:
    directory = tmp_path / "kvobs"
    observer, sink = _engine(directory, engine="0", model_name=model_name)
    for i in range(12):
        record_removal(observer, [_key(i)], "capacity", "store", f"r{i}", [0.5])
    _fail(observer, sink)
    _fail(observer, sink)
    sink.close()
    url = sidecar(directory)
    values = scrape(url)
    assert skipped(values, "journal", "corrupt") == 0 and skipped(values, "report", "corrupt") == 0
    [label] = {dict(ls)["model_name"] for (n, ls), _ in values.items() if n == "kvobs_evicted_chunks_total"}
    if len(model_name) <= 4096 and model_name.isprintable():
        assert label == model_name  # whole: the label joins vLLM's own series
    assert _series(values, "kvobs_evicted_chunks_total", reason="capacity") == [12.0]
    assert _series(values, "kvobs_load_failures_total", cause="coverage_mismatch") == [2.0]
    failures = json.loads(http_get(f"{url}/api/v1/failures")[2])["failures"]
    assert len(failures) == 2 and {f["model_name"] for f in failures} == {label}
    # The report's label is the journal's: the model_name filter finds both.
    query = urllib.parse.urlencode({"model_name": label})
    assert len(json.loads(http_get(f"{url}/api/v1/failures?{query}")[2])["failures"]) == 2


# -- class 2: one long request id costs nobody else's data ------------------------------------------------


def test_one_long_request_id_costs_no_other_requests_evidence(tmp_path: Path, sidecar: Any) -> None:
    directory = tmp_path / "kvobs"
    observer, sink = _engine(directory, engine="0")
    for i in range(6):  # one drained run, one removals line: five requests' evictions and a 5,000-char id
        observer.recorder.removal([_key(i)], 0, [0.5], 1.0 + i, path=0,
                                  req_id="x" * 5000 if i == 2 else f"r{i}")
    _fail(observer, sink, req_id="y" * 5000)  # drains the run; the report carries a 5,000-char id too
    sink.close()
    journal_dir = directory / "journal"
    lines = [line for path in sorted(journal_dir.glob("*.jsonl")) for line in path.read_text().splitlines()]
    [removals] = [json.loads(line) for line in lines if '"k":"removals"' in line]
    assert removals["n"] == 6 and max(len(r) for r in removals["req"]) <= 4096
    # A line written by an older writer, which did not fit its request ids: read, the id fitted.
    older = {**removals, "run": "olderwriter1", "req": [*removals["req"][:2], "z" * 5000, *removals["req"][3:]]}
    (journal_dir / "0-1.000000.jsonl").write_text(json.dumps(older) + "\n")
    url = sidecar(directory)
    values = scrape(url)
    assert skipped(values, "journal", "corrupt") == 0
    assert _series(values, "kvobs_chunk_residency_seconds_count", reason="capacity") == [12.0]
    [report] = json.loads(http_get(f"{url}/api/v1/failures")[2])["failures"]
    assert report["req_id"].startswith("yyy") and len(report["req_id"]) <= 4096


@pytest.mark.slow
@pytest.mark.parametrize("char", ["r", "\u00e9", "\U0001f600", "\x01", '"'],
                         ids=["ascii", "e-acute", "emoji", "control", "quote"])
def test_a_drained_run_is_never_one_line_longer_than_the_reader_takes(tmp_path: Path, sidecar: Any,
                                                                       char: str) -> None:
    """The same class at the line level: 2,048 removals (one drain) by requests whose ids are 4,096
    characters (the request-id limit) made one line over the reader's 8 MiB: every batch lost.
    The writer splits a run into lines the reader takes, measured as written: JSON writes an ``\u00e9``
    as 6 bytes, an emoji as 12, a control character as 6, a quote as 2."""
    directory = tmp_path / "kvobs"
    observer, sink = _engine(directory, engine="0", journal_bytes=256 * 2**20)  # keeps the emoji's 100 MB
    for i in range(2048):
        observer.recorder.removal([_key(i)], 0, [0.5], 1.0 + i, path=0, req_id=f"{i:04d}" + char * 4092)
    observer.drain()
    sink.close()
    segments = sorted((directory / "journal").glob("*.jsonl"))
    lines = [line for path in segments for line in path.read_bytes().split(b"\n")]
    assert max(map(len, lines)) < MAX_LINE_BYTES
    url = sidecar(directory)
    deadline = time.monotonic() + 60  # removals lines are read at most 8 MiB of a file per round
    while (values := scrape(url)) and time.monotonic() < deadline and _series(
            values, "kvobs_chunk_residency_seconds_count", reason="capacity") != [2048.0]:
        time.sleep(0.5)
    assert skipped(values, "journal", "corrupt") == 0
    assert _series(values, "kvobs_chunk_residency_seconds_count", reason="capacity") == [2048.0]
    assert _series(values, "kvobs_eviction_batches_total", reason="capacity") == [2048.0]


# -- class 3: totals ordered by their writer's sequence, not by when they were read -----------------------


def test_a_journal_backlog_is_exported_with_the_newest_totals(tmp_path: Path, sidecar: Any) -> None:
    """A 9 MiB segment (more than one ingest round reads of a file), a roll, a newer segment, and the
    engine dead before the sidecar starts: the totals exported are the engine's last."""
    directory = tmp_path / "kvobs"
    observer, sink = _engine(directory, engine="0", journal_bytes=40 * 2**20)  # 10 MiB segments
    batch = 4096
    serial = 0
    while True:
        for _ in range(8):
            record_removal(observer, [_key(serial * batch + j) for j in range(batch)], "capacity", "store", "r")
            serial += 1
        sink.flush()  # a totals line after each few batches
        [segment, *rest] = sorted((directory / "journal").glob("*.jsonl"))
        if rest:
            break
    sink.close()  # the newest totals, in the second segment
    assert segment.stat().st_size > 9 * 2**20
    truth = observer.evicted["capacity"]
    url = sidecar(directory)
    time.sleep(2.0)  # several ingest rounds: every byte of both segments read
    values = scrape(url)
    assert skipped(values, "journal", "corrupt") == 0
    assert _series(values, "kvobs_evicted_chunks_total", reason="capacity") == [float(truth)]


# -- class 4: every API parameter by one rule set -----------------------------------------------------------


@pytest.mark.parametrize(("query", "parameter"), [
    ("before=garbage", "before"),
    ("before=zzz", "before"),
    ("before=../../etc/passwd", "before"),
    ("before=", "before"),
    ("limit=1_0", "limit"),
    ("limit=+5", "limit"),
    ("limit=%205", "limit"),
    ("since=1_0", "since"),
    ("since=1e300", "since"),
    ("since=-1", "since"),
    ("engine=../dp0", "engine"),
    ("engine=", "engine"),
    ("model_name=a%0Ab", "model_name"),
    ("cause=nope", "cause"),
    ("limit=5&limit=6", "limit"),
    ("befor=1", "befor"),
])
def test_every_api_parameter_is_validated_and_a_bad_one_named(tmp_path: Path, sidecar: Any, query: str,
                                                               parameter: str) -> None:
    directory = tmp_path / "kvobs"
    observer, sink = _engine(directory, engine="0")
    _fail(observer, sink)
    sink.close()
    url = sidecar(directory)
    status, _, body = http_get(f"{url}/api/v1/failures?{query}")
    assert status == 400, body
    error = json.loads(body)
    assert error.get("parameter") == parameter and parameter in error["error"], error


def test_the_cursor_the_api_hands_out_is_accepted(tmp_path: Path, sidecar: Any) -> None:
    directory = tmp_path / "kvobs"
    observer, sink = _engine(directory, engine="dp0:a.b_c-1", model_name="m")
    for _ in range(3):
        _fail(observer, sink)
    sink.close()
    url = sidecar(directory)
    seen, page = [], "/api/v1/failures?limit=1&since=0&engine=dp0:a.b_c-1&model_name=m&cause=coverage_mismatch"
    while page:
        status, _, body = http_get(url + page)
        assert status == 200, body
        data = json.loads(body)
        seen += [f["id"] for f in data["failures"]]
        page = data["next"]
    assert len(seen) == len(set(seen)) == 3


# -- class 5: a number no float holds is refused by the one bounded decoder ---------------------------------


@pytest.mark.parametrize("damage", [
    {"missing_summary": {"counts": [], "ages": {"0": {"counts": [0] * 25, "sum": 10**400}}}},
    {"missing_summary": {"counts": [], "ages": {"0": {"counts": [10**400] + [0] * 24, "sum": 1}}}},
    {"time": 10**400},
    {"history_window_s": 10**400},
    {"missing": [{"seconds_since_eviction": 10**400}]},
    {"num_keys": 10**400},
], ids=["histogram sum", "histogram count", "time", "window", "age", "count"])
def test_a_number_no_float_holds_is_skipped_not_fatal(tmp_path: Path, sidecar: Any, damage: dict[str, Any]) -> None:
    directory = tmp_path / "kvobs"
    observer, sink = _engine(directory, engine="0")
    _fail(observer, sink)
    sink.close()
    [good] = (directory / "failures").glob("*.json")
    report = json.loads(good.read_text())
    (directory / "failures" / "000000000000001-0-1-0.json").write_text(json.dumps({**report, **damage}))
    url = sidecar(directory)
    assert skipped(scrape(url), "report", "corrupt") == 1
    assert len(json.loads(http_get(f"{url}/api/v1/failures")[2])["failures"]) == 1


# -- class 1: one rule for what a report file is, for the sidecar's ingest, its API and kvobs explain ----------


def test_a_file_kvobs_did_not_name_is_not_a_report_to_ingest_the_api_or_explain(tmp_path: Path, sidecar: Any) -> None:
    """The API listed only files named as report ids while ingest and ``kvobs explain --dir`` took any
    ``*.json``: a copy of a real report under another name (an operator's ``cp``, a backup) doubled the
    sidecar's missing-chunk counts and explain's matched reports, yet the API did not serve it. Now one
    listing rule (``wire.decode.report_files``); ingest counts the stray file as skipped, once."""
    directory = tmp_path / "kvobs"
    observer, sink = _engine(directory, engine="0")
    _fail(observer, sink)
    sink.close()
    [real] = (directory / "failures").glob("*.json")
    (directory / "failures" / "copy-of-last-failure.json").write_bytes(real.read_bytes())
    url = sidecar(directory)
    values = scrape(url)
    assert _series(values, "kvobs_missing_chunks_total", cause="coverage_mismatch") == [1.0]  # 2.0 before
    assert skipped(values, "report", "corrupt") == 1  # counted: not silently lost
    assert [f["id"] for f in json.loads(http_get(f"{url}/api/v1/failures")[2])["failures"]] == [real.stem]
    log = tmp_path / "vllm.log"
    log.write_text(f"AssertionError: {json.loads(real.read_text())['message']}\n")
    run = subprocess.run([sys.executable, "-m", "kvobs.cli", "explain", str(log), "--dir", str(directory), "--json"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    [result] = json.loads(run.stdout)
    assert [i for a in result["assertions"] for i in a["reports"]] == [real.stem]  # 2 before
    assert [n for n in result["damage"] if "copy-of-last-failure.json" in n and "skipped" in n], result["damage"]


def test_the_engine_prunes_only_its_own_reports(tmp_path: Path) -> None:
    """The writer's ``max_reports`` pruning listed any ``*.json`` too: a file kvobs did not name counted toward
    the limit and, sorting first, was deleted as the oldest report. It lists by the readers' rule now."""
    directory = tmp_path / "kvobs"
    (directory / "failures").mkdir(parents=True, mode=0o700)
    stray = directory / "failures" / "000000000000000-notes.json"
    stray.write_text("{}")
    observer, sink = _engine(directory, engine="0", max_reports=2)
    for _ in range(3):
        _fail(observer, sink)
    sink.close()
    assert stray.exists()
    assert len(list((directory / "failures").glob("*.json"))) == 3  # the stray and the 2 newest reports
