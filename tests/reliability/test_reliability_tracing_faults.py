"""Tracing faults: an exporter or processor that raises, an OTLP endpoint that is down or hangs.

Each is reproduced for real (the SDK's own processors and OTLP/HTTP exporter, a
closed port, a TCP server that accepts and never answers). vLLM's assertion
leaves kvobs unchanged (same type, vLLM's text first, kvobs's explanation after),
nothing else escapes, the failing load is delayed by at most the bound, kvobs's
own fault is counted and logged once, and the evidence already recorded
(failure counters, the durable report) is all there.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)

from kvobs.sinks import FAILURE_WAIT_S
from kvobs.tracing import provider_from_env
from tests.support.faults import closed_port, observed_cpu, same_failure_as_bare, silent_server
from tests.support.figures import MEASURED

BOUND_S = FAILURE_WAIT_S  # the failure's one deadline, every sink together
SLACK_S = 1.5  # a shared 2-core machine


class RaisingExporter(SpanExporter):
    def __init__(self) -> None:
        self.calls = 0

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.calls += 1
        raise RuntimeError("exporter down")

    def shutdown(self) -> None:
        return None


class RaisingProcessor(SpanProcessor):
    """A third-party processor with bugs in on_end and force_flush."""

    def on_end(self, span: ReadableSpan) -> None:
        raise RuntimeError("processor on_end bug")

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        raise RuntimeError("processor force_flush bug")


def internal_error_logs(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kvobs" and "internal error" in r.getMessage()]


@pytest.mark.parametrize("processor", ["simple", "batch"])
def test_an_exporter_that_raises_changes_nothing(processor: str, tmp_path: Path) -> None:
    exporter = RaisingExporter()
    provider = TracerProvider()
    provider.add_span_processor(
        SimpleSpanProcessor(exporter) if processor == "simple" else BatchSpanProcessor(exporter)
    )
    manager = observed_cpu(tracer_provider=provider, dir=str(tmp_path))
    try:
        same_failure_as_bare(manager, rounds=2)
        obs = manager.observer
        assert exporter.calls >= 1  # the SDK did try, and contained the exporter's error itself
        assert obs.failures["evicted_after_lookup"] == 2
        assert len(list((tmp_path / "failures").glob("*.json"))) == 2  # reports are independent of tracing
    finally:
        manager.shutdown()
        provider.shutdown()


def test_a_processor_that_raises_is_counted_and_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    provider = TracerProvider()
    provider.add_span_processor(RaisingProcessor())
    manager = observed_cpu(tracer_provider=provider, dir=str(tmp_path))
    try:
        with caplog.at_level(logging.ERROR, logger="kvobs"):
            same_failure_as_bare(manager, rounds=3)
        obs = manager.observer
        assert obs.internal_errors["tracing"] == 3  # once per failed load, never raised into vLLM
        assert len(internal_error_logs(caplog)) == 1  # logged once
        assert obs.failures["evicted_after_lookup"] == 3
        assert len(list((tmp_path / "failures").glob("*.json"))) == 3
    finally:
        manager.shutdown()


def test_a_provider_whose_get_tracer_raises_is_contained() -> None:
    class BrokenProvider:
        def get_tracer(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("no tracer")

    manager = observed_cpu(tracer_provider=BrokenProvider())
    try:
        same_failure_as_bare(manager)
        assert manager.observer.internal_errors["tracing"] == 1
    finally:
        manager.shutdown()


def timed_failures(provider: Any, rounds: int) -> list[float]:
    manager = observed_cpu(tracer_provider=provider)
    times = []
    try:
        for _ in range(rounds):
            start = time.monotonic()
            same_failure_as_bare(manager)
            times.append(time.monotonic() - start)
        assert manager.observer.failures["evicted_after_lookup"] == rounds
        # The first span timed out at the bound, the next was skipped while it still exported: both counted.
        assert manager.observer.internal_errors["tracing"] == rounds
    finally:
        start = time.monotonic()
        manager.shutdown()
        assert time.monotonic() - start < BOUND_S + SLACK_S
    return times


def env_provider(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> Any:
    """The provider kvobs builds from the OTEL_* environment in an EngineCore (OTLP/HTTP, batch)."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", endpoint)
    provider = provider_from_env()
    assert provider is not None
    return provider


def test_otlp_endpoint_down_delays_the_failing_load_by_at_most_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    provider = env_provider(monkeypatch, f"http://127.0.0.1:{closed_port()}/v1/traces")
    times = timed_failures(provider, rounds=2)
    # Without kvobs's own bound the SDK retried for ~8 s here (connection refused, backoff).
    assert max(times) < BOUND_S + SLACK_S, times
    MEASURED["otlp_down.failing_load_seconds(max of 2)"] = round(max(times), 3)


def test_otlp_endpoint_that_hangs_delays_the_failing_load_by_at_most_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with silent_server() as port:
        provider = env_provider(monkeypatch, f"http://127.0.0.1:{port}/v1/traces")
        times = timed_failures(provider, rounds=2)
    # Without the bound: 10 s (the exporter's timeout) per failing load.
    assert max(times) < BOUND_S + SLACK_S, times
    assert times[0] >= BOUND_S * 0.9  # it did wait for the span, up to the bound
    MEASURED["otlp_hang.failing_load_seconds(first, second)"] = [round(t, 3) for t in times]


def test_kvobs_own_env_provider_shuts_down_within_the_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no provider given, kvobs builds one from OTEL_*; the engine's shutdown must not wait on a hung collector."""
    from opentelemetry import trace

    import kvobs.tracing as tracing

    with silent_server() as port:
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", f"http://127.0.0.1:{port}/v1/traces")
        monkeypatch.setattr(trace, "get_tracer_provider", lambda: trace.NoOpTracerProvider())
        manager = observed_cpu()
        try:
            start = time.monotonic()
            same_failure_as_bare(manager)
            took = time.monotonic() - start
            assert took < BOUND_S + SLACK_S
            sink = next(s for s in manager.observer.sinks if isinstance(s, tracing.TracingSink))
            assert sink._from_env is not None  # the env path was the one exercised
        finally:
            start = time.monotonic()
            manager.shutdown()
            shutdown = time.monotonic() - start
        assert shutdown < BOUND_S + SLACK_S, shutdown
        MEASURED["otlp_hang.engine_shutdown_seconds"] = round(shutdown, 3)
