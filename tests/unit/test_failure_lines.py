"""The sidecar's structured line per failure report (kvobs.sidecar.log_format): its fields, its JSON in
either log format, and its bound. The reports are real: an observer's journal sink writes them for
real failed loads (no vLLM needed), and the sidecar's own ingest reads them."""

from __future__ import annotations

import io
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import kvobs
from kvobs.diagnosis import MISSING
from kvobs.journal import JournalSink
from kvobs.observer import Observer, Unloadable
from kvobs.options import Options
from kvobs.sidecar import log_format
from kvobs.sidecar.ingest import Ingest
from kvobs.sidecar.log_format import FAILURE_EVENT, SUPPRESSED_EVENT, FailureLines, JsonFormatter, TextFormatter
from kvobs.wire.decode import read_report, report_files


def write_reports(directory: Path, n: int, engine: str = "0", model_name: str = "m-a") -> list[str]:
    """``n`` real failed loads of an observer with a journal sink (cause coverage_mismatch): their
    report ids, oldest first."""
    observer = Observer(Options(engine=engine, model_name=model_name))
    observer.add_sink(JournalSink(directory, observer.options))
    try:
        for i in range(n):
            key = (1000 + i).to_bytes(32, "big") + b"\0\0\0\0"
            diagnosis = observer.load_failed(f"Chunk {key!r} not found in cache", f"req-{i}", 2, (0, 16),
                                             [Unloadable(key, 0, 16, MISSING)], 0)
            observer.publish_failure(diagnosis, AssertionError(diagnosis.message))
    finally:
        observer.close()
    return sorted(path.stem for path in report_files(directory / "failures"))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def captured() -> Iterator[tuple[logging.Logger, io.StringIO]]:
    """A logger writing through the sidecar's text formatter (its default format) into a buffer."""
    buffer = io.StringIO()
    handler = logging.StreamHandler(buffer)
    handler.setFormatter(TextFormatter())
    logger = logging.getLogger("kvobs.test.failure_lines")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.WARNING)
    yield logger, buffer
    logger.removeHandler(handler)


def lines(buffer: io.StringIO) -> list[dict[str, Any]]:
    return [json.loads(line) for line in buffer.getvalue().splitlines()]


def test_a_line_carries_the_reports_facts(tmp_path: Path, captured: tuple[logging.Logger, io.StringIO]) -> None:
    (report_id,) = write_reports(tmp_path, 1)
    report = read_report(tmp_path / "failures" / f"{report_id}.json")
    logger, buffer = captured
    bound = FailureLines(logger)
    assert bound.take(report)
    assert buffer.getvalue() == ""  # taken under the ingest lock, written after it
    bound.write()
    (line,) = lines(buffer)  # JSON although the format is text: a pipeline parses it without a parser
    assert line["event"] == FAILURE_EVENT and line["level"] == "warning"
    assert (line["engine"], line["model_name"], line["cause"]) == ("0", "m-a", "coverage_mismatch")
    assert line["causes"] == {"coverage_mismatch": 1}
    assert line["request_id"] == "req-0" == report.data["req_id"]
    assert (line["report_id"], line["report_path"]) == (report_id, f"/api/v1/failures/{report_id}")
    assert (line["missing_keys"], line["load_keys"], line["recomputed"]) == (1, 2, False)
    assert line["failure_time_unix"] == report.time
    parsed = time.strptime(line["failure_time"][:19], "%Y-%m-%dT%H:%M:%S")
    assert line["failure_time"].endswith("Z") and abs(time.mktime(parsed) - time.timezone - report.time) < 1
    assert line["kvobs_version"] == kvobs.__version__
    assert line["trace_id"] is None and line["span_id"] is None  # no span was sampled: no trace to name
    assert line["suppressed"] == 0
    assert "coverage_mismatch" in line["message"] and report_id in line["message"]


def test_other_records_keep_the_text_format_and_json_merges_the_fields() -> None:
    record = logging.LogRecord("kvobs.sidecar", logging.WARNING, __file__, 1, "plain %s", ("words",), None)
    assert TextFormatter().format(record) == "WARNING kvobs.sidecar: plain words"
    record.fields = {"event": FAILURE_EVENT, "message": "not this one", "engine": "0"}
    entry = json.loads(JsonFormatter().format(record))
    assert entry["message"] == "plain words" and entry["event"] == FAILURE_EVENT and entry["engine"] == "0"
    assert json.loads(TextFormatter().format(record)) == entry


def test_a_flood_is_bounded_and_the_line_that_resumes_says_how_many_were_left_out(
    tmp_path: Path, captured: tuple[logging.Logger, io.StringIO]
) -> None:
    ids = write_reports(tmp_path, 8)
    reports = [read_report(tmp_path / "failures" / f"{i}.json") for i in ids]
    logger, buffer = captured
    clock = Clock()
    bound = FailureLines(logger, burst=3, per_s=1.0, clock=clock)
    assert [bound.take(r) for r in reports[:5]] == [True, True, True, False, False]
    bound.write()  # no token left: nothing but the three
    assert len(lines(buffer)) == 3 and bound.suppressed == 2
    clock.now += 1.0
    assert bound.take(reports[5])  # the next failure's line says so
    bound.write()
    assert lines(buffer)[-1]["suppressed"] == 2 and lines(buffer)[-1]["report_id"] == ids[5]
    assert not bound.take(reports[6])
    clock.now += 0.5
    bound.write()  # half a token: still nothing
    clock.now += 0.5
    bound.write()  # no failure came: a line of its own
    last = lines(buffer)[-1]
    assert (last["event"], last["suppressed"]) == (SUPPRESSED_EVENT, 1)
    bound.write()
    assert len(lines(buffer)) == 5 and bound.suppressed_total == 3
    clock.now += 1000.0  # an idle hour refills the burst, no more
    assert [bound.take(r) for r in reports[:4]] == [True, True, True, False]


def test_the_sidecars_ingest_logs_each_report_once_across_restarts(tmp_path: Path,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    ids = write_reports(tmp_path, 3)

    def ingested() -> list[str]:
        return [r.fields["report_id"] for r in caplog.records if getattr(r, "fields", {}).get("event") == FAILURE_EVENT]

    with caplog.at_level(logging.WARNING, logger="kvobs.sidecar"):
        ingest = Ingest(tmp_path)
        ingest.poll()
        ingest.poll()  # a re-read logs nothing again
        assert sorted(ingested()) == ids
        # Checkpointed in the round that logged them, not CHECKPOINT_EVERY_S later: a sidecar killed now
        # (no checkpoint on its way out) does not log them again.
        saved = json.loads((tmp_path / "sidecar-state.json").read_bytes())
        assert set(ids) <= set(saved["reports_seen"])
        caplog.clear()
        restarted = Ingest(tmp_path)
        restarted.poll()
        assert ingested() == []
        (new,) = set(write_reports(tmp_path, 1, engine="1")) - set(ids)
        restarted.poll()
        assert ingested() == [new]


def test_the_bound_is_the_documented_one() -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert (f"at most {log_format.FAILURE_LINES_BURST} at once, then {log_format.FAILURE_LINES_PER_S:g} a second"
            in " ".join(readme.split()))


def test_the_span_model_attribute_is_the_semantic_conventions_name() -> None:
    from kvobs.tracing import REQUEST_MODEL

    gen_ai = pytest.importorskip("opentelemetry.semconv._incubating.attributes.gen_ai_attributes")
    if not hasattr(gen_ai, "GEN_AI_REQUEST_MODEL"):
        pytest.skip("this opentelemetry-semantic-conventions no longer carries the GenAI names")
    assert REQUEST_MODEL == gen_ai.GEN_AI_REQUEST_MODEL
