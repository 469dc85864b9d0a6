"""Text read from disk is data (issue 40): a lone surrogate anywhere in a journal line or a failure
report is replaced and counted, never the end of a scrape; every exported label stays bounded whatever
fills it, whatever the order; and a client that drops a download never puts a raw traceback in a JSON log.

The sidecar is ``kvobs serve`` in its own process (tests/support/services.py's ``Sidecar``), scraped over
HTTP; the journals and reports are kvobs's own writer's (tests/support/sidecar_input.py), then edited.
"""

from __future__ import annotations

import base64
import json
import os
import random
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvobs.bundles import BUNDLE_FOLDERS, BUNDLE_SUFFIX
from kvobs.codes import CAUSES, DROP_STAGES
from kvobs.sidecar.state import SidecarState
from kvobs.wire.decode import decode_line
from kvobs.wire.format import MAX_ENGINES, MAX_LABEL_VALUES, OTHER, TOTAL_LABELS, Totals, kept_labels
from tests.support.services import ROOT, Sidecar, http_get, wait_for
from tests.support.sidecar_input import scrape, write_engine

LONE = "\udc80"
"""A lone surrogate: valid JSON (``"\\udc80"``), no UTF-8 encodes it."""
Series = dict[tuple[str, frozenset[tuple[str, str]]], float]


def _labels(engine: str, **more: str) -> frozenset[tuple[str, str]]:
    return frozenset({("model_name", ""), ("engine", engine), *more.items()})


def _lines(directory: Path, engine: str) -> tuple[Path, list[dict[str, Any]]]:
    [journal] = (directory / "journal").glob(f"{engine}-*.jsonl")
    return journal, [json.loads(line) for line in journal.read_bytes().splitlines()]


def _append(journal: Path, record: dict[str, Any]) -> None:
    with journal.open("a") as f:
        f.write(json.dumps(record) + "\n")  # ensure_ascii: "\udc80" is written as the escape


def _bad_totals(directory: Path, engine: str) -> None:
    journal, lines = _lines(directory, engine)
    totals = [line for line in lines if line["k"] == "totals"][-1]
    failures = {**totals["failures"], LONE: 1, "evicted_after_lookup": 3}
    _append(journal, {**totals, "q": totals.get("q", 0) + 1, "failures": failures})


def _bad_ages(directory: Path, engine: str) -> None:
    journal, lines = _lines(directory, engine)
    head = {k: lines[0][k] for k in ("e", "pid", "run", "m") if k in lines[0]}
    _append(journal, {"k": "ages", **head, "r": LONE, "ages": base64.b64encode(struct.pack("<f", 1.5)).decode()})


def _bad_hello(directory: Path, engine: str) -> None:
    journal, lines = _lines(directory, engine)
    hello = [line for line in lines if line["k"] == "hello"][-1]
    _append(journal, {**hello, "t": hello["t"] + 1, "version": "0.9" + LONE, "detail": LONE})


def _copy_report(directory: Path, engine: str, n: int, **fields: Any) -> None:
    """Another report of ``engine``, as its first with ``fields`` changed (named as kvobs names them)."""
    first = min((directory / "failures").glob(f"*-{engine}-*.json"))
    data = {**json.loads(first.read_bytes()), **fields}
    if "cause" in fields:  # each missing key's cause too: the counts of kvobs_missing_chunks_total
        summary = data["missing_summary"]
        summary["counts"] = [[fields["cause"], group, n] for _, group, n in summary["counts"]]
    stamp, _, pid, _ = first.stem.rsplit("-", 3)
    (directory / "failures" / f"{int(stamp) + n:015d}-{engine}-{pid}-{n}.json").write_text(json.dumps(data))


def _bad_report(directory: Path, engine: str) -> None:
    _copy_report(directory, engine, 1, cause=LONE, req_id="req-" + LONE)


@pytest.mark.parametrize("spoil", [_bad_totals, _bad_ages, _bad_hello, _bad_report],
                         ids=["totals-label", "ages-reason", "hello-version", "report-cause"])
def test_a_lone_surrogate_is_replaced_and_counted_not_the_end_of_every_scrape(tmp_path: Path, spoil: Any) -> None:
    """Before issue 40 each of these made every /metrics response end with the connection closed, for
    every engine, until the file was gone. Now: 200, the other engine served whole, the bad engine's
    item counted under ``kvobs_dropped_records_total{stage="ingest"}``, the API and ``kvobs explain`` answer."""
    directory = tmp_path / "kvobs"
    write_engine(directory, "good", 5, fail=True)
    write_engine(directory, "bad", 3, fail=True)
    spoil(directory, "bad")
    sidecar = Sidecar(directory).start()
    try:
        def counted() -> Series | None:
            values = scrape(sidecar.url)
            ingest = values.get(("kvobs_dropped_records_total", _labels("bad", stage="ingest")), 0)
            return values if ingest >= 1 else None

        values = wait_for(counted, timeout=15, what="the bad item counted")
        assert values[("kvobs_evicted_chunks_total", _labels("good", reason="capacity"))] == 5
        assert values[("kvobs_evicted_chunks_total", _labels("bad", reason="capacity"))] == 3
        assert values[("kvobs_dropped_records_total", _labels("good", stage="ingest"))] == 0
        status, _, body = http_get(f"{sidecar.url}/api/v1/failures")
        assert status == 200 and len(json.loads(body)["failures"]) >= 2
        assert http_get(f"{sidecar.url}/metrics", {"Accept": "application/openmetrics-text"})[0] == 200
    finally:
        sidecar.stop()
    assert not [line for line in sidecar.log_lines() if "Traceback" in line or "Logging error" in line]
    explained = subprocess.run([sys.executable, "-m", "kvobs.cli", "explain", "--dir", str(directory)],
                               input=b"", capture_output=True, cwd=ROOT, timeout=60)
    assert b"Traceback" not in explained.stderr, explained.stderr.decode(errors="replace")


def test_report_causes_are_bounded_with_one_other_bucket(tmp_path: Path) -> None:
    """150 made-up causes in reports made 156 series; now the causes of one engine are the known ones,
    at most MAX_LABEL_VALUES others and ``other``, every failure still counted, the other engine untouched."""
    directory = tmp_path / "kvobs"
    write_engine(directory, "good", 2, fail=True)
    write_engine(directory, "bad", 2, fail=True)
    made_up = [f"cause_{i:03d}" for i in range(150)]
    for n, cause in enumerate(made_up, start=1):
        _copy_report(directory, "bad", n, cause=cause)
    sidecar = Sidecar(directory).start()
    try:
        def all_read() -> Series | None:
            values = scrape(sidecar.url)
            seen = {dict(labels)["cause"]: v for (name, labels), v in values.items()
                    if name == "kvobs_last_load_failure_timestamp_seconds" and ("engine", "bad") in labels}
            return values if len(seen) and sum(v > 0 for v in seen.values()) >= MAX_LABEL_VALUES + 1 else None

        values = wait_for(all_read, timeout=15, what="every report read")
    finally:
        sidecar.stop()
    def causes(name: str, engine: str) -> set[str]:
        return {dict(labels)["cause"] for (n, labels) in values if n == name and ("engine", engine) in labels}

    for name in ("kvobs_last_load_failure_timestamp_seconds", "kvobs_load_failures_total"):
        assert causes(name, "bad") == {*CAUSES, *made_up[:MAX_LABEL_VALUES], OTHER}, name  # first in sorted order
        assert causes(name, "good") == set(CAUSES), name
    missing = {dict(labels)["cause"]: v for (n, labels), v in values.items()
               if n == "kvobs_missing_chunks_total" and ("engine", "bad") in labels}
    assert missing[OTHER] == 150 - MAX_LABEL_VALUES and sum(missing.values()) == 151


def test_a_totals_map_is_bounded_by_its_values_not_their_order() -> None:
    """The 64-value bound of a totals map depended on the order of its keys: a line with more values than
    the bound kept whichever came first, and a known value could land in ``other``. Now any order of the
    same map reads the same: every known value, the first MAX_LABEL_VALUES others in sorted order, ``other``."""
    made_up = {f"x{i:03d}": 1 for i in range(MAX_LABEL_VALUES + 40)}
    errors = {**made_up, "diagnosis": 7, "journal": 2}
    head = {"k": "totals", "e": "e0", "pid": 1, "run": "r", "t": 1.0, "q": 1}
    read = []
    for seed in range(5):
        items = list(errors.items())
        random.Random(seed).shuffle(items)
        record = decode_line(json.dumps({**head, "errors": dict(items)}).encode())
        assert isinstance(record, Totals)
        read.append(record.counters["errors"])
    assert all(counts == read[0] for counts in read)
    counts = read[0]
    assert counts["diagnosis"] == 7 and counts["journal"] == 2 and counts[OTHER] == 40
    assert set(counts) == {"diagnosis", "journal", *sorted(made_up)[:MAX_LABEL_VALUES], OTHER}
    assert kept_labels(reversed(list(errors)), TOTAL_LABELS["errors"]) == kept_labels(errors, TOTAL_LABELS["errors"])
    assert "ingest" in DROP_STAGES  # the stage the sidecar counts what it replaced under


def test_a_dropped_download_is_logged_as_json_not_a_raw_traceback(tmp_path: Path) -> None:
    """A client that drops GET /api/v1/replays/<id> midway: with ``--log-format json`` every line on
    standard error is JSON (before: socketserver printed the BrokenPipe/ConnectionReset traceback raw)."""
    directory = tmp_path / "kvobs"
    write_engine(directory, "e0", 1)
    folder = directory / BUNDLE_FOLDERS[0]
    folder.mkdir(parents=True, exist_ok=True)
    bundle_id = f"{int(time.time() * 1000):015d}-e0-1-0"
    with (folder / f"{bundle_id}{BUNDLE_SUFFIX}").open("wb") as f:
        f.truncate(64 * 2**20)  # sparse: far more than the socket buffers hold
    sidecar = Sidecar(directory, "--log-format", "json").start()
    try:
        for _ in range(3):
            with socket.create_connection(("127.0.0.1", sidecar.port), timeout=5) as client:
                client.sendall(f"GET /api/v1/replays/{bundle_id} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                assert client.recv(4096).startswith(b"HTTP/1.1 200")
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close: RST
        time.sleep(1.0)
        assert http_get(f"{sidecar.url}/healthz")[0] == 200
    finally:
        sidecar.stop()
    lines = [line for line in sidecar.log_lines() if line.strip()]
    raw = [line for line in lines if not line.startswith("{")]
    assert not raw, "\n".join(lines)
    for line in lines:
        json.loads(line)



def test_engines_beyond_the_bound_are_summed_under_one_other_engine(tmp_path: Path) -> None:
    """A directory naming more engines than ``MAX_ENGINES`` (its journals' lines, read by the sidecar's own
    fold) keeps a series per engine up to the bound; every later one's counts go to ``other``, none lost."""
    write_engine(tmp_path, "e0", 2)
    _, lines = _lines(tmp_path, "e0")
    state = SidecarState()
    extra = 5
    for n in range(MAX_ENGINES + extra):
        for line in lines:
            record = decode_line(json.dumps({**line, "e": f"e{n}"}).encode())
            assert record is not None
            state.apply(record, f"e{n}-1")
    assert len(state.engines) == MAX_ENGINES + 1
    other = state.engines[(OTHER, OTHER)]
    assert len(other.live) == 1 and ("", f"e{MAX_ENGINES + extra - 1}") not in state.engines
    assert sum(sum(h.counts) for h in other.residency.values()) == extra * 2  # 2 samples an overflowed engine


def test_kvobs_explain_reads_a_json_log_with_a_lone_surrogate_and_says_it_replaced_it(tmp_path: Path) -> None:
    """vLLM's real JSON log formatter's line of an EngineCore death (tests/support/crash_log.py), with a lone
    surrogate escape in the traceback's text: the assertion is still found, and the note counts the string."""
    crash = subprocess.run([sys.executable, "-m", "tests.support.crash_log", "bare", "missing", "0"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120,
                           env={**os.environ, "CRASH_LOG_FORMATTER": "json"}, check=True)
    [line] = [line for line in crash.stdout.splitlines() if "not found in cache" in line]
    assert '"exc_info": "Traceback' in line
    log = tmp_path / "vllm.log"
    log.write_text(line.replace('"exc_info": "Traceback', '"exc_info": "\\udc80 Traceback') + "\n")
    run = subprocess.run([sys.executable, "-m", "kvobs.cli", "explain", str(log)], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    assert "not found in cache" in run.stdout and "Traceback (most recent call last)" not in run.stderr
    assert "1 JSON string(s) held text that is not valid (a lone surrogate)" in run.stdout, run.stdout
