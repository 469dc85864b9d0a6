"""One OpenTelemetry span per failed load: ``kv_offload.prepare_load``, status ERROR.

The span carries the standard ``exception`` event and a ``kv_offload.missing_chunks``
event with the structured facts. It is ended and flushed before the exception
leaves kvobs, because the engine is about to die. The bound (``FLUSH_TIMEOUT_MS``)
is kvobs's own: the SDK's ``force_flush(timeout)`` exports in the calling thread
and waits out the exporter's own timeout and retries (measured: ~8 s with the
OTLP endpoint down, 10 s with one that never answers), and a ``SimpleSpanProcessor``
exports inside ``span.end()``. So the span is emitted on a short-lived helper
thread that the failing load waits for at most ``FLUSH_TIMEOUT_MS``; a span still
exporting after that is left to finish in the background (and the next failure's
span is skipped while it does, so threads stay bounded).

Provider: the one given to ``observe()``, else the global one; if
the global one is the API's no-op default and ``OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT``
is set, kvobs builds its own SDK provider with the OTLP exporter the standard
``OTEL_*`` variables describe (http/protobuf by default, grpc on request).
The parent is the request's W3C trace context when the connector carried it,
else an explicit empty context (EngineCore inherits a stale startup
``traceparent``; notes §5).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from kvobs.diagnosis import Diagnosis
from kvobs.observer import Sink

SPAN_NAME = "kv_offload.prepare_load"
EVENT_NAME = "kv_offload.missing_chunks"
FLUSH_TIMEOUT_MS = 2_000
MAX_SPAN_KEYS = 1_000
"""Keys listed per array attribute: a load of 100k keys would make a span of megabytes, over what
OTLP collectors accept (gRPC: 4 MiB), and the span would be lost. The rest are counted."""


def provider_from_env() -> Any | None:
    """An SDK TracerProvider exporting OTLP as the ``OTEL_*`` environment says, or None."""
    if not (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")):
        return None
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    protocol = (
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or ""
    ).strip()
    exporter: Any
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        exporter = GrpcExporter()
    else:
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        exporter = HttpExporter()
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", "kvobs")})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


def event_attributes(diagnosis: Diagnosis) -> dict[str, Any]:
    """The structured facts of a failed load as OTel attributes (no None inside arrays)."""
    failure = diagnosis.failure
    listed = diagnosis.keys[:MAX_SPAN_KEYS]
    attrs: dict[str, Any] = {
        "kv_offload.req_id": failure.req_id,
        "kv_offload.cause": diagnosis.cause,
        "kv_offload.num_keys": failure.num_keys,
        "kv_offload.num_missing": len(diagnosis.keys),
        "kv_offload.history.keys": failure.history_keys,
        "kv_offload.history.window_s": failure.history_window_s,
        "kv_offload.missing.end_tokens": [-1 if k.facts.end_token is None else k.facts.end_token for k in listed],
        "kv_offload.missing.seconds_since_eviction": [-1.0 if k.age_s is None else k.age_s for k in listed],
        "kv_offload.missing.causes": [k.cause for k in listed],
        "kv_offload.missing.groups": [k.facts.group for k in listed],
        "kv_offload.missing.not_listed": len(diagnosis.keys) - len(listed),
    }
    if failure.failing_group is not None:
        attrs["kv_offload.group"] = failure.failing_group
    if failure.end_token_range is not None:
        attrs["kv_offload.end_token.min"], attrs["kv_offload.end_token.max"] = failure.end_token_range
    return attrs


class SpanExportTimeout(TimeoutError):
    """The failure span was not exported within the bound (counted as a kvobs fault, never raised to vLLM)."""


class TracingSink(Sink):
    """Emits the failure span; see the module docstring."""

    stage = "tracing"

    def __init__(self, tracer_provider: Any = None) -> None:
        self._given = tracer_provider
        self._from_env: Any = None
        self._straggler: threading.Thread | None = None

    def _provider(self) -> Any:
        if self._given is not None:
            return self._given
        provider = trace.get_tracer_provider()
        if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
            if self._from_env is None:
                self._from_env = provider_from_env()
            if self._from_env is not None:
                return self._from_env
        return provider

    def on_failure(self, diagnosis: Diagnosis, exc: BaseException) -> None:
        """Emit and flush the span on a helper thread; wait at most FLUSH_TIMEOUT_MS."""
        if self._straggler is not None and self._straggler.is_alive():
            raise SpanExportTimeout("the previous failure span is still exporting; this one is skipped")
        errors: list[BaseException] = []

        def emit() -> None:
            try:
                self._emit(diagnosis, exc)
            except BaseException as fault:  # handed to the failing load's thread below
                errors.append(fault)

        worker = threading.Thread(target=emit, name="kvobs-failure-span", daemon=True)
        worker.start()
        worker.join(FLUSH_TIMEOUT_MS / 1000)
        if worker.is_alive():
            self._straggler = worker
            raise SpanExportTimeout(f"failure span not exported within {FLUSH_TIMEOUT_MS} ms; left to finish")
        if errors:
            raise errors[0]

    def _emit(self, diagnosis: Diagnosis, exc: BaseException) -> None:
        from kvobs import __version__

        provider = self._provider()
        tracer = provider.get_tracer("kvobs", __version__)
        parent = parent_context(diagnosis.failure.trace_headers)
        span = tracer.start_span(SPAN_NAME, context=parent, kind=trace.SpanKind.INTERNAL)
        try:
            span.set_attribute("kv_offload.req_id", diagnosis.failure.req_id)
            span.set_attribute("kv_offload.cause", diagnosis.cause)
            span.record_exception(exc, escaped=True)
            span.add_event(EVENT_NAME, event_attributes(diagnosis))
            span.set_status(Status(StatusCode.ERROR, f"{diagnosis.cause}: {diagnosis.failure.vllm_message[:200]}"))
        finally:
            span.end()
        flush = getattr(provider, "force_flush", None)
        if flush is not None:
            flush(FLUSH_TIMEOUT_MS)

    def close(self) -> None:
        """Shut down a provider kvobs built itself, waiting at most FLUSH_TIMEOUT_MS (an engine's shutdown)."""
        if self._from_env is not None:
            worker = threading.Thread(target=self._from_env.shutdown, name="kvobs-tracer-shutdown", daemon=True)
            worker.start()
            worker.join(FLUSH_TIMEOUT_MS / 1000)
            if worker.is_alive():
                raise SpanExportTimeout(f"tracer provider shutdown did not finish within {FLUSH_TIMEOUT_MS} ms")


def parent_context(trace_headers: Mapping[str, str] | None) -> Context:
    """The request's trace context from W3C headers, else an explicit empty context."""
    if trace_headers:
        return TraceContextTextMapPropagator().extract(carrier=dict(trace_headers), context=Context())
    return Context()
