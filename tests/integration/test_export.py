"""The evidence leaves the engine: sidecar + real Prometheus, real OTLP, and a crashing engine."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from prometheus_client.parser import text_string_to_metric_families
from vllm.v1.kv_offload.base import ReqContext

import kvobs
from tests.support.services import ROOT, OtlpReceiver, Prometheus, Sidecar, http_get, wait_for
from tests.support.vllm_env import cpu_extra, create_manager, evicted_after_lookup_then_coverage_mismatch, key

ENGINE = "tests.support.engine_process"  # run as a module, the repository root on PYTHONPATH


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver()
    yield r
    r.stop()


def attrs(items: object) -> dict[str, object]:
    out: dict[str, object] = {}
    for kv in items:  # type: ignore[attr-defined]
        value = kv.value
        kind = value.WhichOneof("value")
        out[kv.key] = (
            [getattr(v, v.WhichOneof("value")) for v in value.array_value.values] if kind == "array_value"
            else getattr(value, kind)
        )
    return out


@pytest.mark.tools
@pytest.mark.slow
def test_workload_metrics_reach_a_real_prometheus(tmp_path: Path, receiver: OtlpReceiver) -> None:
    directory = tmp_path / "kvobs"
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{receiver.endpoint}/v1/traces")))
    manager = kvobs.observe(create_manager(cpu_extra(4)), dir=str(directory), engine="dp0", tracer_provider=provider)
    sidecar = Sidecar(directory).start()
    prometheus = Prometheus(tmp_path / "prom", [f"127.0.0.1:{sidecar.port}"]).start()
    try:
        writer, victim = ReqContext("writer"), ReqContext("req-a")
        for context in (writer, victim):
            manager.on_new_request(context)
        evicted_after_lookup_then_coverage_mismatch(manager, writer, victim)
        obs = manager.observer
        assert obs.evicted["capacity"] == 20

        def scraped(expr: str, want: float) -> bool:
            return prometheus.value(expr) == want

        wait_for(lambda: scraped('kvobs_evicted_chunks_total{engine="dp0",reason="capacity"}', 20), what="evictions")
        batches = prometheus.value('kvobs_eviction_batches_total{engine="dp0",reason="capacity"}')
        assert batches == obs.batches["capacity"]
        assert prometheus.value('kvobs_evicted_chunks_total{engine="dp0",reason="reset"}') == 0  # pre-initialised
        failed = 'kvobs_load_failures_total{engine="dp0",cause="evicted_after_lookup"}'
        wait_for(lambda: scraped(failed, 1), what="failures")
        assert prometheus.value('kvobs_load_failures_total{engine="dp0",cause="coverage_mismatch"}') == 1
        assert prometheus.value('kvobs_load_failures_total{engine="dp0",cause="unknown"}') == 0
        assert prometheus.value('kvobs_missing_chunks_total{cause="coverage_mismatch",group="1"}') == 1
        assert prometheus.value('kvobs_missing_chunks_total{cause="evicted_after_lookup",group="0"}') == 1
        assert prometheus.value('kvobs_hits_evicted_before_load_total{reason="capacity"}') == 1
        assert prometheus.value('kvobs_chunk_residency_seconds_count{reason="capacity"}') == 20
        assert prometheus.value('kvobs_chunk_residency_seconds_bucket{reason="capacity",le="86400.0"}') == 20
        assert prometheus.value('kvobs_missing_chunk_eviction_age_seconds_count{group="0"}') == 1
        assert prometheus.value("kvobs_history_chunks") == 20
        assert prometheus.value('kvobs_build_info{engine="dp0"}') == 1
        assert prometheus.value('kvobs_dropped_records_total{stage="journal"}') == 0

        # The span and both events, from the SDK's own OTLP exporter, before the assertion left kvobs.
        spans = [s for s in receiver.spans() if s.name == "kv_offload.prepare_load"]
        assert len(spans) == 2
        first = spans[0]
        assert first.status.code == 2  # STATUS_CODE_ERROR
        events = {e.name: attrs(e.attributes) for e in first.events}
        assert events["exception"]["exception.type"] == "AssertionError"
        assert str(events["exception"]["exception.message"]).startswith(f"Chunk {key(118)!r} not found in cache")
        assert "exception.stacktrace" in events["exception"]
        facts = events["kv_offload.missing_chunks"]
        assert facts["kv_offload.req_id"] == "req-a" and facts["kv_offload.cause"] == "evicted_after_lookup"
        assert facts["kv_offload.num_missing"] == 1 and facts["kv_offload.missing.end_tokens"] == [160]
        assert facts["kv_offload.group"] == 0

        status, _, body = http_get(f"{sidecar.url}/api/v1/failures")
        reports = json.loads(body)["failures"]
        assert status == 200 and [r["cause"] for r in reports] == ["coverage_mismatch", "evicted_after_lookup"]
        assert reports[1]["missing"][0]["last_removal"]["path"] == "store"
        status, content_type, body = http_get(
            f"{sidecar.url}/metrics", {"Accept": "application/openmetrics-text; version=1.0.0"}
        )
        assert status == 200 and content_type.startswith("application/openmetrics-text") and body.endswith(b"# EOF\n")
    finally:
        manager.shutdown()
        prometheus.stop()
        sidecar.stop()


@pytest.mark.slow
def test_crashed_engines_evidence_survives_and_two_engines_are_labelled_apart(
    tmp_path: Path, receiver: OtlpReceiver
) -> None:
    directory = tmp_path / "kvobs"
    sidecar = Sidecar(directory).start()
    env = {**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "PYTHONPATH": str(ROOT)}
    try:
        engines = [
            subprocess.Popen([sys.executable, "-m", ENGINE, str(directory), "dp0", "30", "fail"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE),
            subprocess.Popen([sys.executable, "-m", ENGINE, str(directory), "dp1", "20", "ok"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE),
        ]
        outputs = [p.communicate(timeout=120) for p in engines]
        assert engines[0].returncode == 1 and b"AssertionError: Chunk" in outputs[0][1]
        assert b"cause: evicted_after_lookup" in outputs[0][1]
        assert engines[1].returncode == 0, outputs[1][1].decode()[-2000:]

        def metric(text: str, series: str) -> float | None:
            """The value of the one sample ``series`` (PromQL-style selector, exact labels) selects."""
            name, _, selector = series.partition("{")
            want = dict(re.findall(r'(\w+)="([^"]*)"', selector))
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == name and {k: sample.labels.get(k) for k in want} == want:
                        return float(sample.value)
            return None

        def final_values() -> tuple[float | None, ...]:
            text = http_get(f"{sidecar.url}/metrics")[2].decode()
            return (
                metric(text, 'kvobs_evicted_chunks_total{engine="dp0",reason="capacity"}'),
                metric(text, 'kvobs_evicted_chunks_total{engine="dp1",reason="capacity"}'),
                metric(text, 'kvobs_load_failures_total{cause="evicted_after_lookup",engine="dp0"}'),
            )

        # dp0: 32 rounds of 4 chunks into 8 slots = 120 evicted; dp1: 22 rounds = 80.
        wait_for(lambda: final_values() == (120.0, 80.0, 1.0), what="final counters of both engines")
        reports = json.loads(http_get(f"{sidecar.url}/api/v1/failures")[2])["failures"]
        summary = [(r["engine"], r["cause"], r["req_id"]) for r in reports]
        assert summary == [("dp0", "evicted_after_lookup", "req-victim")]
        spans = wait_for(lambda: [s for s in receiver.spans() if s.name == "kv_offload.prepare_load"], what="span")
        assert len(spans) == 1  # exported by the dying engine, via the OTEL_* environment

        # The sidecar restarts: it resumes from its checkpoint, counting nothing twice.
        sidecar.stop()
        sidecar = Sidecar(directory).start()
        assert final_values() == (120.0, 80.0, 1.0)
    finally:
        sidecar.stop()


def test_journal_and_reports_are_private_files(tmp_path: Path) -> None:
    directory = tmp_path / "kvobs"
    manager = kvobs.observe(create_manager(cpu_extra(2)), dir=str(directory))
    a = ReqContext("a")
    manager.on_new_request(a)
    with pytest.raises(AssertionError):
        manager.prepare_load([key(1)], a)
    manager.shutdown()
    for path in [directory / "journal", directory / "failures", *directory.rglob("*.json*")]:
        mode = path.stat().st_mode & 0o777
        assert mode & 0o077 == 0, (path, oct(mode))


def test_failure_span_joins_the_requests_trace_when_the_connector_carried_it() -> None:
    """ObservedOffloadingConnector stores Request.trace_headers on the ReqContext; the span joins that trace."""
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from kvobs.vllm.trace_context import TraceHeaders

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    manager = kvobs.observe(create_manager(cpu_extra(2)), tracer_provider=provider)
    trace_id, parent_id = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    a = ReqContext("req-a")
    a.set_state(TraceHeaders({"traceparent": f"00-{trace_id}-{parent_id}-01"}))
    manager.on_new_request(a)
    with pytest.raises(AssertionError):
        manager.prepare_load([key(1)], a)
    (span,) = exporter.get_finished_spans()
    assert span.name == "kv_offload.prepare_load"
    assert f"{span.context.trace_id:032x}" == trace_id and span.parent is not None
    assert f"{span.parent.span_id:016x}" == parent_id
    b = ReqContext("req-b")  # no carried context: a fresh trace, not EngineCore's stale startup one
    manager.on_new_request(b)
    with pytest.raises(AssertionError):
        manager.prepare_load([key(2)], b)
    assert exporter.get_finished_spans()[1].parent is None
    manager.shutdown()


def test_reset_of_a_large_cpu_tier_reaches_the_residency_histogram_whole(tmp_path: Path) -> None:
    """One removal batch of 40,000 chunks is journaled as bounded lines (its first KEYS_LISTED keys
    named, every age carried), and the sidecar folds every age of it."""
    from prometheus_client.parser import text_string_to_metric_families

    from kvobs.wire.format import AGES_PER_LINE, KEYS_LISTED

    chunks = 100_000
    assert chunks > KEYS_LISTED + AGES_PER_LINE
    manager = kvobs.observe(create_manager(cpu_extra(chunks)), dir=str(tmp_path), engine="dp0")
    writer = ReqContext("writer")
    manager.on_new_request(writer)
    for start in range(0, chunks, 1000):
        keys = [key(start + i) for i in range(1000)]
        manager.prepare_store(keys, writer)
        manager.complete_store(keys, writer)
    manager.reset_cache()
    manager.shutdown()
    journal = b"".join(p.read_bytes() for p in (tmp_path / "journal").glob("*.jsonl"))
    ages_lines = [line for line in journal.splitlines() if b'"k":"ages"' in line and b'"r":"reset"' in line]
    assert len(ages_lines) == -(-(chunks - KEYS_LISTED) // AGES_PER_LINE)  # the ages the removals line cannot list
    assert max(len(line) for line in journal.splitlines()) < 2**20
    sidecar = Sidecar(tmp_path).start()
    try:
        def reset_count() -> float | None:
            text = http_get(f"{sidecar.url}/metrics")[2].decode()
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == "kvobs_chunk_residency_seconds_count" and sample.labels["reason"] == "reset":
                        return sample.value
            return None

        assert wait_for(lambda: reset_count() == chunks, what="100,000 reset ages at the sidecar")
        text = http_get(f"{sidecar.url}/metrics")[2].decode()
        assert 'kvobs_sidecar_skipped_total{reason="corrupt",source="journal"} 0.0' in text
    finally:
        sidecar.stop()
