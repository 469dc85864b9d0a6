"""Traces: the standard OTEL_* variables as an EngineCore reads them at start, the request id where
vLLM's spans keep it, and the link from the sidecar's failure counter to the failure's trace.

Real parts throughout: engines are processes (``tests/support/engine_process.py``, a real observed vLLM manager
that dies on the failed load), spans go through the SDK's own OTLP/HTTP exporter to a real HTTP
receiver (``services.OtlpReceiver``) or to the SDK's console exporter, and the exemplar is read
from a real ``kvobs serve`` in OpenMetrics.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF
from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics_families
from prometheus_client.parser import text_string_to_metric_families
from vllm.v1.kv_offload.base import ReqContext

import kvobs
from kvobs.wire.decode import decode_report
from tests.support.services import ROOT, SPAN, OtlpReceiver, Sidecar, attrs, http_get, received, wait_for
from tests.support.vllm_env import cpu_extra, create_manager, evicted_after_lookup_then_coverage_mismatch, key

ENGINE = "tests.support.engine_process"  # run as a module, the repository root on PYTHONPATH
OPENMETRICS = {"Accept": "application/openmetrics-text; version=1.0.0"}
OTEL_VARS = ("OTEL_TRACES_EXPORTER", "OTEL_SERVICE_NAME", "OTEL_RESOURCE_ATTRIBUTES", "OTEL_SDK_DISABLED",
             "OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_PROTOCOL",
             "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL")


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    r = OtlpReceiver()
    yield r
    r.stop()


class Engine:
    """An engine process that dies on its failed load, with these OTEL_* variables only."""

    def __init__(self, directory: Path, otel: dict[str, str]) -> None:
        self.dir = directory
        env = {k: v for k, v in os.environ.items() if k not in OTEL_VARS}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", ENGINE, str(directory), "dp0", "4", "fail"],
            env={**env, **otel, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        self.stdout = self.stderr = ""

    def wait(self) -> Engine:
        out, err = self.proc.communicate(timeout=180)
        self.stdout, self.stderr = out.decode(errors="replace"), err.decode(errors="replace")
        # vLLM's assertion left the engine unchanged, whatever the tracing configuration.
        assert self.proc.returncode == 1 and "AssertionError: Chunk" in self.stderr, self.stderr[-3000:]
        assert "cause: evicted_after_lookup" in self.stderr
        return self

    def report(self) -> dict[str, Any]:
        (path,) = (self.dir / "failures").glob("*.json")
        data = json.loads(path.read_bytes())
        assert decode_report(path.stem, data) is not None
        return dict(data)


def run_engines(tmp_path: Path, cases: dict[str, dict[str, str]]) -> dict[str, Engine]:
    """Start every case's engine at once (each imports vLLM: seconds), then wait for all."""
    engines = {name: Engine(tmp_path / name, otel) for name, otel in cases.items()}
    return {name: engine.wait() for name, engine in engines.items()}


def console_spans(stdout: str) -> list[dict[str, Any]]:
    """The spans ConsoleSpanExporter printed (indented JSON objects, among whatever else is on stdout)."""
    decoder = json.JSONDecoder()
    spans = []
    lines = stdout.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.rstrip() == "{":
            try:
                obj, _ = decoder.raw_decode("".join(lines[i:]))
            except ValueError:
                continue
            if isinstance(obj, dict) and obj.get("name") == SPAN:
                spans.append(obj)
    return spans


@pytest.mark.slow
def test_traces_exporter_variable_is_honoured(tmp_path: Path) -> None:
    """OTEL_TRACES_EXPORTER: none exports nothing even with an endpoint set; console prints the span;
    an unknown value is warned about by name and exports nothing; unset with an endpoint is otlp."""
    receivers = {name: OtlpReceiver() for name in ("none", "default", "unknown", "otlp_and_typo")}
    try:
        endpoint = {name: {"OTEL_EXPORTER_OTLP_ENDPOINT": r.endpoint} for name, r in receivers.items()}
        engines = run_engines(tmp_path, {
            "none": endpoint["none"] | {"OTEL_TRACES_EXPORTER": "none"},
            "default": endpoint["default"],
            "unknown": endpoint["unknown"] | {"OTEL_TRACES_EXPORTER": "zipkn"},
            "otlp_and_typo": endpoint["otlp_and_typo"] | {"OTEL_TRACES_EXPORTER": "otlp,consol"},
            "console": {"OTEL_TRACES_EXPORTER": "console"},
        })
        # The control: the same engine with only the endpoint set did export (the receiver works).
        ((resource, span),) = received(receivers["default"])
        assert resource["service.name"] == "kvobs"
        assert engines["default"].report()["trace_id"] == span.trace_id.hex()

        assert received(receivers["none"]) == []
        assert engines["none"].report()["trace_id"] is None  # no span, no trace to point at

        assert received(receivers["unknown"]) == []
        assert "unknown exporter 'zipkn'" in engines["unknown"].stderr
        assert engines["unknown"].stderr.count("Traceback") == 1  # vLLM's assertion's, nothing of kvobs's

        assert len(received(receivers["otlp_and_typo"])) == 1  # the known one still exports
        assert "unknown exporter 'consol'" in engines["otlp_and_typo"].stderr

        (printed,) = console_spans(engines["console"].stdout)
        assert printed["status"]["status_code"] == "ERROR"
        assert printed["attributes"]["gen_ai.request.id"] == "req-victim"
        assert printed["resource"]["attributes"]["service.name"] == "kvobs"
        assert printed["context"]["trace_id"] == "0x" + engines["console"].report()["trace_id"]
    finally:
        for r in receivers.values():
            r.stop()


@pytest.mark.slow
def test_service_name_follows_the_standard_precedence(tmp_path: Path) -> None:
    """OTEL_SERVICE_NAME > service.name in OTEL_RESOURCE_ATTRIBUTES > kvobs; other resource attributes kept."""
    receivers = {name: OtlpReceiver() for name in ("attributes", "both")}
    try:
        run_engines(tmp_path, {
            "attributes": {"OTEL_EXPORTER_OTLP_ENDPOINT": receivers["attributes"].endpoint,
                           "OTEL_RESOURCE_ATTRIBUTES": "service.name=x,deployment.environment=staging"},
            "both": {"OTEL_EXPORTER_OTLP_ENDPOINT": receivers["both"].endpoint,
                     "OTEL_RESOURCE_ATTRIBUTES": "service.name=x,k8s.pod.name=engine-0",
                     "OTEL_SERVICE_NAME": "vllm-engine"},
        })
        ((resource, _),) = received(receivers["attributes"])
        assert resource["service.name"] == "x" and resource["deployment.environment"] == "staging"
        ((resource, _),) = received(receivers["both"])
        assert resource["service.name"] == "vllm-engine" and resource["k8s.pod.name"] == "engine-0"
    finally:
        for r in receivers.values():
            r.stop()


def exemplars(sidecar: Sidecar) -> dict[str, tuple[str, float, float]]:
    """cause -> (exemplar trace_id, exemplar value, exemplar timestamp) of kvobs_load_failures_total,
    from an OpenMetrics scrape (parsed by prometheus_client's OpenMetrics parser)."""
    status, content_type, body = http_get(f"{sidecar.url}/metrics", OPENMETRICS)
    assert status == 200 and content_type.startswith("application/openmetrics-text")
    out = {}
    for family in openmetrics_families(body.decode()):
        for sample in family.samples:
            if sample.name == "kvobs_load_failures_total" and sample.exemplar is not None:
                ex = sample.exemplar
                out[sample.labels["cause"]] = (ex.labels["trace_id"], ex.value, float(ex.timestamp))
    return out


def test_failure_counter_exemplar_carries_the_trace_id_the_backend_received(
    tmp_path: Path, receiver: OtlpReceiver
) -> None:
    directory = tmp_path / "kvobs"
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{receiver.endpoint}/v1/traces")))
    manager = kvobs.observe(create_manager(cpu_extra(4)), dir=str(directory), engine="dp0", tracer_provider=provider)
    sidecar = Sidecar(directory).start()
    try:
        writer, victim = ReqContext("writer"), ReqContext("req-a")
        for context in (writer, victim):
            manager.on_new_request(context)
        evicted_after_lookup_then_coverage_mismatch(manager, writer, victim)

        spans = {attrs(s.attributes)["kv_offload.cause"]: s for _, s in received(receiver)}
        assert set(spans) == {"evicted_after_lookup", "coverage_mismatch"}
        span = spans["evicted_after_lookup"]
        # The request id where vLLM's own spans keep it, and kvobs's own attribute still.
        assert attrs(span.attributes)["gen_ai.request.id"] == "req-a"
        assert attrs(span.attributes)["kv_offload.req_id"] == "req-a"

        reports = {r["cause"]: r for r in json.loads(http_get(f"{sidecar.url}/api/v1/failures")[2])["failures"]}
        for cause, s in spans.items():
            assert reports[cause]["trace_id"] == s.trace_id.hex() and reports[cause]["span_id"] == s.span_id.hex()

        found = wait_for(lambda: len(exemplars(sidecar)) == 2 and exemplars(sidecar), what="two exemplars")
        for cause, s in spans.items():
            assert found[cause] == (s.trace_id.hex(), 1.0, reports[cause]["time"])
        # The Prometheus text format has no exemplars: the same scrape without OpenMetrics still parses.
        text = http_get(f"{sidecar.url}/metrics")[2].decode()
        assert "trace_id" not in text and list(text_string_to_metric_families(text))

        # A later failure of the same series replaces its exemplar (one per series: bounded).
        late = ReqContext("req-late")
        manager.on_new_request(late)
        with pytest.raises(AssertionError, match="cause: coverage_mismatch"):
            manager.prepare_load([key(998, group=1)], late)
        newest = wait_for(lambda: [s for _, s in received(receiver)
                                   if attrs(s.attributes)["gen_ai.request.id"] == "req-late"], what="late span")
        wait_for(lambda: exemplars(sidecar)["coverage_mismatch"][0] == newest[0].trace_id.hex(),
                 what="the newest failure's exemplar")
        assert exemplars(sidecar)["evicted_after_lookup"][0] == span.trace_id.hex()

        # A restarted sidecar keeps them (its checkpoint), though it reads no report twice.
        sidecar.stop()
        sidecar = Sidecar(directory).start()
        assert exemplars(sidecar)["coverage_mismatch"][0] == newest[0].trace_id.hex()
    finally:
        manager.shutdown()
        sidecar.stop()
        provider.shutdown()


def test_the_span_carries_the_semantic_conventions_attributes(tmp_path: Path, receiver: OtlpReceiver) -> None:
    """error.type (the cause), the served model as gen_ai.request.model, the engine label as kvobs.engine,
    status ERROR with a description; no model attribute where kvobs knows no model name."""
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{receiver.endpoint}/v1/traces")))
    named = kvobs.observe(create_manager(cpu_extra(4)), dir=str(tmp_path / "a"), engine="0", model_name="m-a",
                          tracer_provider=provider)
    unnamed = kvobs.observe(create_manager(cpu_extra(2)), dir=str(tmp_path / "b"), engine="dp1",
                            tracer_provider=provider)
    try:
        writer, victim = ReqContext("writer"), ReqContext("req-a")
        for context in (writer, victim):
            named.on_new_request(context)
        evicted_after_lookup_then_coverage_mismatch(named, writer, victim)
        other = ReqContext("req-b")
        unnamed.on_new_request(other)
        with pytest.raises(AssertionError, match="cause: coverage_mismatch"):
            unnamed.prepare_load([key(1)], other)
    finally:
        named.shutdown()
        unnamed.shutdown()
        provider.shutdown()
    spans = {(attrs(s.attributes)["kvobs.engine"], attrs(s.attributes)["kv_offload.cause"]): s
             for _, s in received(receiver)}
    assert set(spans) == {("0", "evicted_after_lookup"), ("0", "coverage_mismatch"), ("dp1", "coverage_mismatch")}
    for (engine, cause), span in spans.items():
        found = attrs(span.attributes)
        assert found["error.type"] == cause  # kvobs's class of the error; the exception's type is in its event
        assert {e.name: attrs(e.attributes) for e in span.events}["exception"]["exception.type"] == "AssertionError"
        assert span.status.code == 2 and span.status.message.startswith(f"{cause}: Chunk ")  # ERROR
        if engine == "0":
            assert found["gen_ai.request.model"] == "m-a"
        else:
            assert "gen_ai.request.model" not in found


def test_an_unsampled_failure_span_is_not_linked(tmp_path: Path) -> None:
    """A span the sampler dropped reaches no backend: the report and the sidecar name no trace."""
    directory = tmp_path / "kvobs"
    provider = TracerProvider(sampler=ALWAYS_OFF)
    manager = kvobs.observe(create_manager(cpu_extra(2)), dir=str(directory), engine="dp0", tracer_provider=provider)
    try:
        a = ReqContext("req-a")
        manager.on_new_request(a)
        with pytest.raises(AssertionError):
            manager.prepare_load([key(1)], a)
    finally:
        manager.shutdown()
    (path,) = (directory / "failures").glob("*.json")
    report = json.loads(path.read_bytes())
    assert report["trace_id"] is None and report["span_id"] is None
    sidecar = Sidecar(directory).start()
    try:
        wait_for(lambda: json.loads(http_get(f"{sidecar.url}/api/v1/failures")[2])["failures"], what="the report")
        assert exemplars(sidecar) == {}
    finally:
        sidecar.stop()


@pytest.mark.parametrize("bad", ["0" * 32, "ABCDEF" + "0" * 25 + "1", "abc", 7])
def test_a_report_with_a_malformed_trace_id_is_not_read(bad: object) -> None:
    report = {"kind": "failure", "engine": "dp0", "time": 1.0, "cause": "unknown",
              "missing_summary": {"counts": [], "ages": {}}, "trace_id": "4bf92f3577b34da6a3ce929d0e0e4736"}
    assert decode_report("r", report) is not None
    assert decode_report("r", report | {"trace_id": bad}) is None
