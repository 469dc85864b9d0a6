"""One OpenTelemetry span per failed load: ``kv_offload.prepare_load``, status ERROR.

The span carries the standard ``exception`` event and a ``kv_offload.missing_chunks``
event with the structured facts. It is ended and flushed (bounded by
``FLUSH_TIMEOUT_MS``) before the exception leaves kvobs, because the engine is
about to die. Provider: the one given to ``observe()``, else the global one; if
the global one is the API's no-op default and ``OTEL_EXPORTER_OTLP_(TRACES_)ENDPOINT``
is set, kvobs builds its own SDK provider with the OTLP exporter the standard
``OTEL_*`` variables describe (http/protobuf by default, grpc on request).
The parent is the request's W3C trace context when the connector carried it,
else an explicit empty context (EngineCore inherits a stale startup
``traceparent``; notes §5).
"""

from __future__ import annotations

import os
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
    attrs: dict[str, Any] = {
        "kv_offload.req_id": failure.req_id,
        "kv_offload.cause": diagnosis.cause,
        "kv_offload.num_keys": failure.num_keys,
        "kv_offload.num_missing": len(diagnosis.keys),
        "kv_offload.history.keys": failure.history_keys,
        "kv_offload.history.window_s": failure.history_window_s,
        "kv_offload.missing.end_tokens": [
            -1 if k.facts.end_token is None else k.facts.end_token for k in diagnosis.keys
        ],
        "kv_offload.missing.seconds_since_eviction": [-1.0 if k.age_s is None else k.age_s for k in diagnosis.keys],
        "kv_offload.missing.causes": [k.cause for k in diagnosis.keys],
        "kv_offload.missing.groups": [k.facts.group for k in diagnosis.keys],
    }
    if failure.failing_group is not None:
        attrs["kv_offload.group"] = failure.failing_group
    if failure.end_token_range is not None:
        attrs["kv_offload.end_token.min"], attrs["kv_offload.end_token.max"] = failure.end_token_range
    return attrs


class TracingSink(Sink):
    """Emits the failure span; see the module docstring."""

    def __init__(self, tracer_provider: Any = None) -> None:
        self._given = tracer_provider
        self._from_env: Any = None

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
        if self._from_env is not None:
            self._from_env.shutdown()


def parent_context(trace_headers: Mapping[str, str] | None) -> Context:
    """The request's trace context from W3C headers, else an explicit empty context."""
    if trace_headers:
        return TraceContextTextMapPropagator().extract(carrier=dict(trace_headers), context=Context())
    return Context()
