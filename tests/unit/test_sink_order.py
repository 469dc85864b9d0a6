"""Sinks know nothing of each other: the observer makes one failure event (the diagnosis and its
trace's ids) and hands it to every sink, so the order they were added in changes nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from kvobs.diagnosis import MISSING
from kvobs.journal import JournalSink
from kvobs.observer import Observer, Unloadable
from kvobs.options import Options
from kvobs.sinks import FailureEvent, Sink
from kvobs.tracing import SPAN_NAME, TracingSink

KEY = (7).to_bytes(32, "big") + b"\0\0\0\0"


class Recording(Sink):
    """A third sink: what it was handed."""

    def __init__(self) -> None:
        self.events: list[FailureEvent] = []

    def on_failure(self, event: FailureEvent) -> None:
        self.events.append(event)


def _fail_once(directory: Path, order: str) -> tuple[dict[str, Any], Any, FailureEvent, FailureEvent]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    observer = Observer(Options(engine="0", model_name="m"))
    journal = JournalSink(directory, observer.options)
    tracer = TracingSink(provider)
    other = Recording()
    sinks = {"journal_first": (journal, other, tracer), "tracer_first": (tracer, other, journal),
             "other_first": (other, tracer, journal)}[order]
    for sink in sinks:
        observer.add_sink(sink)
    diagnosis = observer.load_failed(f"Chunk {KEY!r} not found in cache", "req-a", 1, None,
                                     [Unloadable(KEY, 0, None, MISSING)], 0)
    event = observer.publish_failure(diagnosis, AssertionError(diagnosis.message))
    observer.close()
    provider.shutdown()
    (path,) = (directory / "failures").glob("*.json")
    (span,) = exporter.get_finished_spans()
    assert span.name == SPAN_NAME
    assert not +observer.internal_errors, observer.internal_errors
    (seen,) = other.events
    return json.loads(path.read_bytes()), span, event, seen


@pytest.mark.parametrize("order", ["tracer_first", "other_first"])
def test_the_report_names_the_trace_whatever_order_the_sinks_were_added_in(tmp_path: Path, order: str) -> None:
    reports = {}
    for how in ("journal_first", order):
        report, span, event, seen = _fail_once(tmp_path / how, how)
        ids = (f"{span.context.trace_id:032x}", f"{span.context.span_id:016x}")
        assert (report["trace_id"], report["span_id"]) == ids == event.trace
        assert seen is event  # every sink gets the one event, trace ids included
        reports[how] = report
    varying = ("time", "trace_id", "span_id", "run", "pid")
    first, second = ({k: v for k, v in r.items() if k not in varying} for r in reports.values())
    assert first == second
